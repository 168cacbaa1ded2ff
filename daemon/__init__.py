"""genie-daemon: executes clients' op streams on a GPU (or the CPU) and keeps results resident.

Installed as the import package `genie_daemon`. It imports only genie.transport
(the wire) from Genie, never the client frontend or runtime; its entry point (entry.py) marks
the process so that importing genie.transport loads nothing of the client either.
"""
