"""Our built-in training worker: a torchvision CNN under DDP, resumable at any step.

Run as ``python -m elastic.training.worker --config FILE`` (what ``elastic-agent --config``
starts). Modules: :mod:`~elastic.training.config` (the validated YAML),
:mod:`~elastic.training.data`, :mod:`~elastic.training.model`,
:mod:`~elastic.training.sampler` (the exact data cursor), :mod:`~elastic.training.train`
(one step) and :mod:`~elastic.training.worker` (the loop, stop and resume).
"""

__all__: list[str] = []
