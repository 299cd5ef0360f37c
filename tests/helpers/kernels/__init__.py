"""Kernel test cases and the references they are checked against."""
