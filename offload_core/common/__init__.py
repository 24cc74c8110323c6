"""Layer 6: what every layer above shares: the options (``config.py``), which handle owns which
module and the torch hooks that report changes (``changes.py``), the undo log (``transaction.py``)
and the record of a run (``timeline.py``, ``overlap.py``, ``labels.py``)."""
