"""Worker classes the plugin names in ``parallel_config.worker_cls``.

Each is vLLM's own worker whose model runner is the vattention runner
(:class:`.runner.VAttentionRunnerMixin` in front of vLLM's runner class). vLLM's workers build
their runner inside ``init_device`` with a hard-coded class, so ``init_device`` builds vLLM's and
then replaces it with ours before any model or KV cache exists (the first one only held empty
input buffers). ``shutdown`` gives back the slots still held and writes the final statistics.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from .runner import VAttentionRunnerMixin

__all__ = ["VAttentionCPUModelRunner", "VAttentionCPUWorker", "VAttentionGPUModelRunner",
           "VAttentionGPUWorker"]


class VAttentionCPUModelRunner(VAttentionRunnerMixin, CPUModelRunner):
    """vLLM's CPU model runner with its KV cache in vattention."""


class VAttentionGPUModelRunner(VAttentionRunnerMixin, GPUModelRunner):
    """vLLM's GPU model runner with its KV cache in vattention (needs ``enforce_eager``)."""


class _VAttentionWorkerMixin:
    runner_cls: type

    def init_device(self) -> None:
        super().init_device()
        self.model_runner = self.runner_cls(self.vllm_config, self.device)

    def shutdown(self) -> None:
        runner = getattr(self, "model_runner", None)
        if isinstance(runner, VAttentionRunnerMixin):
            runner.close_vattention()
        super().shutdown()


class VAttentionCPUWorker(_VAttentionWorkerMixin, CPUWorker):
    """vLLM's CPU worker running :class:`VAttentionCPUModelRunner`."""

    runner_cls = VAttentionCPUModelRunner


class VAttentionGPUWorker(_VAttentionWorkerMixin, Worker):
    """vLLM's GPU worker running :class:`VAttentionGPUModelRunner`."""

    runner_cls = VAttentionGPUModelRunner
