"""Running the pipeline for people and machines: configuration, the live daemon, replay and
check, the summary and status lines, logging, the metrics endpoint and systemd notification.
"""
