"""Pure parsers: mindformers log text in, typed records out. No I/O, no clocks."""
