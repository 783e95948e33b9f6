"""Which CUDA stream a cache orders its work on: the caller's current torch stream, by default.

A cache call that may unmap pages a kernel still reads (``free``, a ``step`` that releases window
pages), or that copies or zeroes pages (``fork``, swap, scrubbing), orders that work behind a fence
on a stream: unmapping is not stream-ordered on CUDA, so the fence must follow the kernels that
really read the pages. Serving engines run their models on streams of their own (vLLM sets a
non-blocking stream current for its worker), which the legacy default stream does not wait for;
so when a call names no stream, the cache takes the stream torch says is current on its device,
the one the caller's kernels are queued on.

Under ``torch.compile`` the lookup runs eagerly, at run time (a graph break there): a traced
``torch.cuda.current_stream()`` is a generic ``torch.Stream`` without the driver handle, and a
handle read at trace time would be baked into the graph, wrong for every later call. The cache
calls that take a stream (``step``, ``free``, ...) map or unmap pages, which belongs outside
compiled code (docs/compile.md); a compiled function that makes one all the same gets the right
stream.

Examples
--------
>>> from vattention import streams
>>> streams.current_stream("cpu")   # host memory: nothing is asynchronous, handle 0
0
"""

from __future__ import annotations

from typing import Any, Union

import torch

__all__ = ["current_stream"]


def current_stream(device: Union[str, torch.device]) -> int:
    """The driver handle of the caller's current torch stream on ``device``, for a cache call.

    Parameters
    ----------
    device : str or torch.device
        The cache's device (``KVCacheConfig.device``).

    Returns
    -------
    int
        ``torch.cuda.current_stream(device).cuda_stream`` for a CUDA device once torch has
        initialised CUDA in this process; else 0, the legacy default stream (a process that has
        queued no CUDA work through torch has nothing else to order after).

    Examples
    --------
    >>> current_stream("cpu")
    0
    """
    if torch.compiler.is_compiling():
        return _outside_the_graph(device)
    return _handle(device)


def _handle(device: Union[str, torch.device]) -> int:
    stream = _torch_stream(torch.device(device))
    return 0 if stream is None else int(stream.cuda_stream)


def _torch_stream(dev: torch.device) -> Any:
    """torch's current stream on a CUDA ``dev`` once torch has initialised CUDA, else None."""
    if dev.type != "cuda" or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_stream(dev)


def _outside_the_graph(device: Union[str, torch.device]) -> int:
    """:func:`_handle` run by dynamo as a call it does not trace. Only reached while dynamo
    traces, so ``torch._dynamo`` is loaded already: importing it at module level would cost every
    ``import vattention`` seconds."""
    import torch._dynamo

    return int(torch._dynamo.disable(_handle)(device))
