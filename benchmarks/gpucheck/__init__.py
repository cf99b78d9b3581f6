"""The parts of ``benchmarks/gpu_check.py`` (see its docstring): sizes and device helpers
(:mod:`.device`), time limits and the run of one part (:mod:`.run`), the planner part
(:mod:`.planner`), the other parts (:mod:`.parts`), and the summary (:mod:`.summary`)."""
