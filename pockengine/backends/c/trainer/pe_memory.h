/* --memory-report: where the trainer's resident memory is, read from /proc/self/status
 * (Linux) after the last step. */
#ifndef PE_MEMORY_H
#define PE_MEMORY_H

#include <stddef.h>
#include <stdio.h>

/* One line to ``out``: the whole-process peak (VmHWM) and the resident set split into
 * anonymous memory (the arena, the state block, the code's data, libc) and file pages
 * (the mapped frozen tensors, the code), then what the trainer itself holds: ``arena``,
 * ``state`` and ``mapped`` bytes. The resident parts only grow during a run (nothing is
 * freed before the report), so after the last step they are the split at the peak. On a
 * system without /proc the process figures read "n/a". */
void pe_memory_report(FILE *out, size_t arena, size_t state, size_t mapped);

#endif
