/* metrics.h: a small thread-safe Prometheus metrics registry (counters, gauges, histograms,
 * summaries with labels) rendered in the text exposition format 0.0.4 for GET /metrics. Many threads
 * update series while one renders; each family has its own mutex, so an update costs one
 * lock, a hash lookup and an add.
 *
 * Naming, as `promtool check metrics` wants it:
 *   - a counter's exposed name ends in "_total" everywhere (HELP, TYPE and sample lines, as
 *     the Go and Python clients write 0.0.4 text): metrics_counter(m, "x_tokens", ...) and
 *     metrics_counter(m, "x_tokens_total", ...) both expose the family "x_tokens_total";
 *   - names may contain ':' (valid Prometheus), but promtool's linter warns about every
 *     such name ("colons are reserved for recording rules"): prefer "caraserve_";
 *   - units in base units spelled out ("_seconds", "_bytes"), no camelCase.
 * Output order is deterministic: families in registration order, series in creation order
 * (a removed and re-created series goes to the end). */
#ifndef CS_SERVER_METRICS_H
#define CS_SERVER_METRICS_H

#include <stddef.h>

#define METRICS_MAX_LABELS 8
#define METRICS_MAX_BUCKETS 64

typedef struct metrics metrics_t;   /* a registry: owns its families */
typedef struct metric metric_t;     /* one family: a counter, gauge, histogram or summary */

metrics_t *metrics_new(void);       /* NULL when out of memory */
/* Frees the registry and every family in it; no thread may use them any more. NULL is a
 * no-op. */
void metrics_free(metrics_t *m);

/* Register a family. name: [a-zA-Z_:][a-zA-Z0-9_:]*; help: any text (escaped on output),
 * not NULL; label_names: a NULL-terminated array of up to METRICS_MAX_LABELS distinct names
 * [a-zA-Z_][a-zA-Z0-9_]* not starting with "__", or NULL for none ("le" is reserved for
 * histograms, "quantile" for summaries). Strings are copied. Returns NULL with cs_error_last() set (CS_EINVAL for a
 * bad or already registered name, CS_ENOMEM). A family without labels starts with its one
 * series at 0 so that it is exposed before the first update; a labelled one exposes only
 * HELP and TYPE until a series is used.
 * Histogram buckets: n_buckets upper bounds, finite and strictly increasing (a trailing
 * +Inf is accepted and ignored; "+Inf" is always added), at most METRICS_MAX_BUCKETS.
 * A summary has no quantiles: each series is exposed as name_sum and name_count only (a
 * histogram without buckets, for a mean where the distribution is not wanted). */
metric_t *metrics_counter(metrics_t *m, const char *name, const char *help, const char *const *label_names);
metric_t *metrics_gauge(metrics_t *m, const char *name, const char *help, const char *const *label_names);
metric_t *metrics_histogram(metrics_t *m, const char *name, const char *help, const char *const *label_names,
                            const double *buckets, int n_buckets);
metric_t *metrics_summary(metrics_t *m, const char *name, const char *help, const char *const *label_names);

/* Updates. label_values: one non-NULL string per label name, in the registration order
 * (NULL for a family without labels); any bytes (invalid UTF-8 is rendered as U+FFFD).
 * The series is created on first use. If memory runs out creating a series the update is
 * dropped (metrics are best effort); a wrong kind of family or a negative counter increment
 * is a programming error (CS_ASSERT). */
void metric_inc(metric_t *f, const char *const *label_values, double v);     /* counter (v >= 0), gauge */
void metric_set(metric_t *f, const char *const *label_values, double v);     /* gauge */
void metric_observe(metric_t *f, const char *const *label_values, double v); /* histogram, summary */
/* Drops one series (an unloaded adapter's gauge); no-op when it does not exist. */
void metric_remove(metric_t *f, const char *const *label_values);

/* Folds the label value `from` into `to`, to keep a label's set of values bounded (the top
 * adapters by name, the rest as "_other"): every series whose label label_name is `from` is
 * added into the series with the same other label values and label_name = `to` (created
 * at the end of the creation order when missing), then removed. Counters, gauges and
 * summaries add value (sum) and count, histograms every bucket too; a gauge thus becomes
 * the total of the folded ones, meaningful for a count (requests running), not for a level
 * (an adapter's rank). One step under the family's lock: an update or a render sees the
 * series before or after the fold, never both or neither. No-op when the family has no
 * label label_name, when no series has `from`, or when from equals to; a series whose
 * target cannot be created (no memory) stays as it is. */
void metric_fold(metric_t *f, const char *label_name, const char *from, const char *to);
/* The number of series the family has now (a labelled family's distinct label sets). */
size_t metric_series_count(metric_t *f);

/* Renders every family in the text exposition format 0.0.4 (Content-Type
 * "text/plain; version=0.0.4; charset=utf-8") into a NUL-terminated malloc'd string; *len
 * (may be NULL) gets its length. NULL when out of memory. Each family is a consistent
 * snapshot; different families may be read at slightly different times. */
char *metrics_render(metrics_t *m, size_t *len);

#endif
