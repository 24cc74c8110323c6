from vendor import vendor_backend  # noqa: F401 (the stand-in vendor backend of tests/backends, a fixture)
