"""This machine's facts that building and measuring both need: how fast it multiplies per dtype
(compute_rate), which dtype to compute and store in (dtype_choice), and whether a run fits in its
free memory (memory_guard). Model building (ficoco.models) and measurement (ficoco.profiling) both
import it; it imports neither."""
