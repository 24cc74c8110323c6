"""Layer 7 beside the device layer: the library's exceptions (``errors.py``) and how its locks
are taken (``locks.py``); neither imports anything of the library, so every layer can raise and
lock."""
