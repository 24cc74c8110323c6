from vendor import vendor_backend  # noqa: F401 (the stand-in vendor backend, a fixture of several files)
