"""Writing TensorBoard runs and the checkpoint that depends on them.

tfrecord framing -> event_file (one file, durable) -> run_writer (one run, exactly once);
event_scan reads runs back as TensorBoard would; layout is the custom-scalars layout run;
state is the checkpoint; lock keeps one writer per --out and instance.
"""
