"""Imported by tests/runtime/forked_job.py's launcher only: a child that has it was forked."""
