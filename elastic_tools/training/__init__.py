"""Our built-in training worker: a torchvision CNN under DDP, resumable at any step.

Run as ``python -m elastic_tools.training.worker --config FILE`` (what ``elastic-agent --config``
starts). Modules: :mod:`~elastic_tools.training.config` (the validated YAML),
:mod:`~elastic_tools.training.data`, :mod:`~elastic_tools.training.model`,
:mod:`~elastic_tools.training.sampler` (the exact data cursor), :mod:`~elastic_tools.training.train`
(one step) and :mod:`~elastic_tools.training.worker` (the loop, stop and resume).
"""

__all__: list[str] = []
