"""The checkpoint package's version, in a leaf: the manifest records it (``checkpoint.commit``) without importing the
package's face."""

__version__ = "0.1.0"
