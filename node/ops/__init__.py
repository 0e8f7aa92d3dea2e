"""What an operator touches: the ``primenode`` CLI, the daemon behind ``bootstrap`` and
``join``, the status server and ``primenode status``, the checkpoint progress bar,
``primenode devnet`` and its churn driver, and ``primenode dataset filter``.

Nothing else in the project imports this package (tests/system/test_layout.py): the
roles, networking and checkpoint code take their settings as arguments.
"""
