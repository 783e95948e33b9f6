"""Worker classes the plugin names in ``parallel_config.worker_cls``.

Each is vLLM's own worker whose model runner is the vattention runner
(:class:`.runner.VAttentionRunnerMixin` in front of vLLM's V1 runner class, which the plugin
selects: see plugin.py). vLLM's GPU worker builds its runner in ``_make_model_runner``, its plugin
point for exactly this; the CPU worker builds its runner inside ``init_device`` with a fixed
class, so ``init_device`` builds vLLM's and then replaces it with ours before any model or KV cache
exists (the first one only held empty input buffers). ``shutdown`` gives back the slots still held
and writes the final statistics.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from .runner import VAttentionRunnerMixin

__all__ = [
    "VAttentionCPUModelRunner",
    "VAttentionCPUWorker",
    "VAttentionGPUModelRunner",
    "VAttentionGPUWorker",
]


class VAttentionCPUModelRunner(VAttentionRunnerMixin, CPUModelRunner):
    """vLLM's CPU model runner with its KV cache in vattention."""


class VAttentionGPUModelRunner(VAttentionRunnerMixin, GPUModelRunner):
    """vLLM's (V1) GPU model runner with its KV cache in vattention."""


class _ShutdownMixin:
    def shutdown(self) -> None:
        runner = getattr(self, "model_runner", None)
        if isinstance(runner, VAttentionRunnerMixin):
            runner.close_vattention()
        # The vLLM worker after this mixin in the MRO (mypy checks super() against object)
        super().shutdown()  # type: ignore[misc]


class VAttentionCPUWorker(_ShutdownMixin, CPUWorker):
    """vLLM's CPU worker running :class:`VAttentionCPUModelRunner`."""

    def init_device(self) -> None:
        super().init_device()
        self.model_runner = VAttentionCPUModelRunner(self.vllm_config, self.device)


class VAttentionGPUWorker(_ShutdownMixin, Worker):
    """vLLM's GPU worker running :class:`VAttentionGPUModelRunner`."""

    def _make_model_runner(self) -> GPUModelRunner:
        if self.use_v2_model_runner:  # the plugin selects V1 (plugin.select_v1_runner)
            raise RuntimeError(
                "vattention: vLLM chose its V2 model runner although the plugin "
                "set VLLM_USE_V2_MODEL_RUNNER=0; please report this"
            )
        return VAttentionGPUModelRunner(self.vllm_config, self.device)
