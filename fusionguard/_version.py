"""The version string, alone in a file: ``setup.cfg`` reads it without importing the package."""

__version__ = "0.1.0"
