"""What records mean across files and ranks: ordering (sequencer), the cross-rank aggregate,
alerts, and the accounting of every record not written.
"""
