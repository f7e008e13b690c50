/* --memory-report (pe_memory.h). */
#include "pe_memory.h"

#include <stdlib.h>
#include <string.h>

/* The kB value of ``key`` in /proc/self/status, or -1. */
static long status_kb(const char *key) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long kb = -1;
    size_t n = strlen(key);
    while (fgets(line, sizeof(line), f))
        if (!strncmp(line, key, n) && line[n] == ':') { /* strtol, not sscanf: no scanf linked */
            char *end;
            long v = strtol(line + n + 1, &end, 10);
            if (end != line + n + 1 && v >= 0) kb = v;
            break;
        }
    fclose(f);
    return kb;
}

static void mib(FILE *out, const char *label, long kb) {
    if (kb < 0) fprintf(out, " %s n/a", label);
    else fprintf(out, " %s %.1f", label, (double)kb / 1024.0);
}

void pe_memory_report(FILE *out, size_t arena, size_t state, size_t mapped) {
    fprintf(out, "memory MiB:");
    mib(out, "peak", status_kb("VmHWM"));
    mib(out, "rss", status_kb("VmRSS"));
    mib(out, "anon", status_kb("RssAnon"));
    mib(out, "file", status_kb("RssFile"));
    fprintf(out, " | arena %.1f state %.1f mapped %.1f\n", (double)arena / 1048576.0,
            (double)state / 1048576.0, (double)mapped / 1048576.0);
}
