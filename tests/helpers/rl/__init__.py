"""The RL tests' trainer process, worker extension and weight-update cases."""
