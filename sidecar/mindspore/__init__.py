"""MindSpore summary (_MS) files: decoded (ms_summary) and followed like logs (ms_follow).

The in-process callback stays at sidecar.inprocess, its public import path.
"""
