"""Downstream evaluation tasks run by `tasks/main.py`."""
