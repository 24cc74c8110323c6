"""``python -m offload_core``: the ``offload-core`` command, for environments without the script."""

from .cli import main

raise SystemExit(main())
