"""Everything that talks to Ray, HTTP or the command line: the `raypage` command and its benchmarks."""
