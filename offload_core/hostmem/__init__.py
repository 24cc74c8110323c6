"""Host memory: where each weight unit's home lives (pinned, pageable, on disk), the budgets that
decide it, the bounce ring and stager that move homes without pinned memory, and safetensors
reads and spills. See ``docs/bigger-than-ram.md``."""
