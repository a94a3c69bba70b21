"""The transport: collectives with timeouts, process groups and meshes, buckets, the record.

Every collective gradaccum issues goes through [`Comm`][gradaccum.sync.Comm] (``comm``), which
logs it in the record (``record``) that ``record_collectives()`` reads.
"""
