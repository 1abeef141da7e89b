"""Following logs: which files, in what order, and their bytes as complete lines.

discovery (what to follow) -> tailer (one file by identity, through rotation and truncation)
-> chains (a file with its rotated backups, one rank's stream through them, their order);
wakeup tells the live loop when to look again.
"""
