"""Storage backends of a checkpoint root, one module and one class each (``api.StorageBackend``):

* ``local``: POSIX (local disk, ``file://``, FSx/Lustre): temp file, ``fsync``, ``rename``, ``fsync`` of the
  directory; symlinks confined to the root; ranged reads straight into the destination.
* ``s3``: one PUT for small files, a multipart upload with parallel parts for large ones.
* ``generic``: any other fsspec filesystem (``memory://``, gcs, ...): each file written in one piece.

``storage.open_backend`` picks one from the location, once; ``storage.Storage`` adds retries and error
conversion on top. A new storage tier is a new module here plus one line in ``open_backend``.
"""
