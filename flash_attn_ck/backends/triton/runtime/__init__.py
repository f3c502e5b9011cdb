"""What both kernel families launch through: launch specs and the direct launch path, replay, the tested Triton
releases, the varlen schedule, and the row kernels that both backward paths run (delta, casts, zeroing, rows outside
every sequence)."""
