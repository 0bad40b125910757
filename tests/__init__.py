"""The test suite, a package so that its modules import the shared ``tests.oracle`` and ``tests.helpers``."""
