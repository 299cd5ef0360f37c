"""The package version, on the ground floor so that any layer can report it without importing the package face."""
__version__ = "0.1.0"
