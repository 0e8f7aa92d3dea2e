"""The learning machinery of a run, usable in one process: tasks and datasets,
rule-based rewards, filters, the GRPO trainer and its metrics.

Roles (trainer, worker, validator) call into this package; nothing here does
network I/O. See docs/rl.md.
"""
