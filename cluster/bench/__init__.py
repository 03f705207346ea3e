"""`raypage bench ...`: benchmarks that print a summary and write their results as JSON."""
