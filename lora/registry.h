/* registry.h: the two tiers of LoRA adapters.
 *
 * The host tier: adapters are registered by name (each add of a name is a new version; rank,
 * targets and bytes are probed then) and loaded on first use by the io_uring loader thread
 * into a host cache bounded in bytes and in count, evicting adapters that nobody holds:
 * those used once first, then the rest, each least recently used first (a tail of adapters
 * asked for once does not push out the ones asked for again). Acquire never blocks on disk: it answers CS_EAGAIN while a load runs (or
 * waits for room) and the engine retries after on_loaded fires. States per version:
 * ON_DISK -> LOADING -> RESIDENT (-> ON_DISK when evicted), or FAILED: until re-added when the
 * file's content is wrong; for LORA_RETRY_MS when the disk failed (EIO, a missing file, no
 * memory), after which the next acquire loads it again.
 *
 * The device tier: a RESIDENT adapter may also hold a slot on the compute backend
 * (backend_adapter_t: its weights in the backend's memory), with a budget of its own in
 * bytes and in slots, its own LRU and its own references. A host reference (acquire) is what
 * a request holds from admission to its end, waiting and preempted included; a device
 * reference is held only while one of its sequences runs (is in the batch), so requests that
 * wait never pin a slot and starve admission. A slot never outlives its host copy: evicting
 * or dropping the host copy frees the slot first. */
#ifndef CS_LORA_REGISTRY_H
#define CS_LORA_REGISTRY_H

#include "backend/backend.h"
#include "base/common.h"
#include "base/model_config.h"
#include "lora/peft.h"

typedef struct lora_registry lora_registry_t;

typedef enum lora_state { LORA_ON_DISK, LORA_LOADING, LORA_RESIDENT, LORA_FAILED } lora_state;
#define LORA_RETRY_MS 1000.0 /* a load the disk failed is tried again this long after */

typedef struct lora_ref {            /* what an acquirer holds; valid until lora_registry_release */
    const lora_adapter_t *adapter;   /* A/B per layer x target (lora/peft.h) */
    const char *name;
    int version;                     /* 1, 2, ... bumped by each lora_registry_add of the same name */
} lora_ref_t;

typedef struct lora_registry_params {
    const model_config_t *cfg;       /* base model the adapters must fit; must outlive the registry */
    bool buffered_io;                /* adapter files through the page cache, not O_DIRECT
                                      * (lora/loader_uring.h) */
    bool hold_bf16;                  /* every adapter held in BF16, F32 and F16 weights rounded
                                      * (--lora-dtype bf16: lora_adapter_load_as) */
    size_t cache_bytes;              /* host cache bound in bytes of A/B/Bᵀ held (BF16 adapters
                                      * count half, as they are held); 0 = unbounded */
    int max_loras;                   /* bound on resident adapters; 0 = unbounded */
    void (*on_loaded)(void *user);   /* called (from the loader thread) after any load finishes, ok or
                                      * failed, with no registry lock held; must be cheap (the engine
                                      * uses it to wake up) */
    void (*on_load_time)(void *user, const char *name, double seconds); /* optional: after each successful load
                                      * (loader thread, no lock held): disk to resident time */
    void (*on_dropped)(void *user, const char *name, int version, const char *dir); /* optional:
                                      * a version that is no longer kept was freed (its last
                                      * holder released it); called with the registry lock held,
                                      * so it must be cheap and must not call the registry (the
                                      * server removes uploaded files here) */
    void *user;
    /* the device tier (optional): adapter slots on DEVICE, the engine's backend */
    struct backend *device;          /* NULL: no device tier (device_acquire gives no slot) */
    size_t device_bytes;             /* device bytes of the slots (backend_adapter_bytes; 0 for a
                                      * host-memory backend using the weights in place); 0 = unbounded */
    int device_slots;                /* adapters with a slot at once; 0 = unbounded */
    int stream_group;                /* > 0: a slot streams in, this many layers at a time
                                      * (backend_adapter_stream), usable from its first group
                                      * on (the cold start); 0: uploaded whole before use */
    bool stream_host;                /* with stream_group, on a device that can take it
                                      * (backend_caps: adapter_feed): an adapter file is read chunk by
                                      * chunk in layer order, and acquire hands the adapter out
                                      * (CS_OK, state still LOADING) once its header is read:
                                      * its layers come in behind (lora_adapter_t.host_layers,
                                      * fed to its device slot as they come). The holder must
                                      * check that count, and lora_adapter_failed: a load that
                                      * fails part way fails only the requests holding it */
    void (*on_streamed)(void *user, const char *name, double seconds); /* optional: a slot finished
                                      * streaming in: upload to last layer's arrival (called on
                                      * the loader thread, no lock held, NAME valid during the
                                      * call). on_loaded is also called after each layer group,
                                      * on the loader thread too: the backend's copy thread only
                                      * queues them, as it must never wait for a lock. */
    double fresh_ms;                 /* grace of a freshly loaded adapter that its requester has
                                      * not taken yet: a waiting load may not evict it before
                                      * (0: LORA_FRESH_MS_DEFAULT, 500 ms) */
} lora_registry_params_t;

#define LORA_FRESH_MS_DEFAULT 500.0

/* Create an empty registry and start its loader thread (io_uring). The bounds count every
 * adapter held in host memory: resident ones, old versions still held, and loads that have
 * reserved their room. */
int lora_registry_new(const lora_registry_params_t *p, lora_registry_t **out);

/* Stop the loader thread (loads in flight are finished or cancelled first; on_loaded is not
 * called any more) and free every adapter. No lora_ref_t may be outstanding: that is
 * asserted. NULL does nothing. */
void lora_registry_free(lora_registry_t *r);

/* Register NAME as the PEFT directory DIR, or re-point it: each call makes a new version
 * (*version, if not NULL, gets it; versions keep counting across remove). Only
 * adapter_config.json and the safetensors header are read now (lora_adapter_probe: rank,
 * targets, dtype, exact bytes; lora_registry_info); the weights are read when the version
 * is first acquired, and a broken adapter is reported then, not here. Later acquires get the new
 * version; holders of an older one keep it until they release it, then it is freed (unless
 * keep_versions keeps it: lora_registry_add_ex); an
 * older version still loading is dropped when its load ends. CS_EINVAL for an empty name or
 * dir, CS_ENOMEM. */
int lora_registry_add(lora_registry_t *r, const char *name, const char *dir, int *version);

/* The general form. VERSION 0 numbers it after the last one. ACTIVATE makes it what
 * acquire of NAME gets (else it is staged: acquirable by number, activated later; a name's
 * first version must be activated). KEEP_VERSIONS > 0 sets how many versions NAME keeps
 * (sticky; 1 until set): beyond that the oldest ones that are not active are dropped, and
 * live on only while requests hold them. Kept versions can be evicted from the host cache
 * like any adapter and are reloaded from DIR when acquired again. */
int lora_registry_add_ex(lora_registry_t *r, const char *name, const char *dir, int version, bool activate,
                         int keep_versions, int *out_version);
/* Make kept version VERSION of NAME the active one; KEEP_VERSIONS > 0 also sets how many are
 * kept (as for add); dir (if not NULL) gets the version's directory. CS_ENOTFOUND when it is
 * not kept. */
int lora_registry_activate(lora_registry_t *r, const char *name, int version, int keep_versions, char *dir,
                           size_t dirlen);
/* Drop kept version VERSION of NAME: CS_EBUSY when it is the active one or requests hold it,
 * CS_ENOTFOUND when it is not kept. */
int lora_registry_remove_version(lora_registry_t *r, const char *name, int version);

/* Unregister NAME: later acquires fail with CS_ENOTFOUND; versions still held are freed at
 * their last release. CS_ENOTFOUND if NAME is not registered. */
int lora_registry_remove(lora_registry_t *r, const char *name);

/* Take a reference to NAME's current version. Returns
 *   CS_OK with *out (valid until lora_registry_release) when it is resident;
 *   CS_EAGAIN when a load was started by this call, is in progress, or waits for cache room
 *     (every cached adapter is held): retry after on_loaded fires. A freshly loaded adapter
 *     is kept for its requesters for half a second before a waiting load may evict it, so
 *     retrying every pending acquire on each on_loaded is enough to make progress;
 *   CS_ENOTFOUND when NAME is not registered;
 *   the load's error (CS_EFORMAT, CS_ESHAPE, CS_EIO, CS_ENOTFOUND, CS_EUNSUPPORTED, CS_ENOMEM
 *     for an adapter larger than the whole cache, ...) when its load failed, with a
 *     cs_error_last() message naming the adapter, its version and the file; it stays failed
 *     until the name is re-added.
 * Never blocks on I/O. Thread-safe (engine thread and HTTP threads). */
int lora_registry_acquire(lora_registry_t *r, const char *name, lora_ref_t **out);

/* The same for a given kept VERSION of NAME (0: the active one); CS_ENOTFOUND naming the
 * kept versions when VERSION is not one of them. */
int lora_registry_acquire_version(lora_registry_t *r, const char *name, int version, lora_ref_t **out);
/* A request pinned to kept version VERSION (> 0) of NAME holds it from submission on, before
 * it can acquire it: while pinned it stays kept (keep_versions passes over it, remove_version
 * answers CS_EBUSY), and a remove of NAME lets it live until unpinned. CS_ENOTFOUND (naming
 * the kept versions) when it is not kept. acquire_pinned answers as lora_registry_acquire;
 * every pin ends with one unpin (after the release of what acquire_pinned gave). */
typedef struct lora_pin lora_pin_t;
int lora_registry_pin(lora_registry_t *r, const char *name, int version, lora_pin_t **out);
int lora_registry_acquire_pinned(lora_registry_t *r, lora_pin_t *pin, lora_ref_t **out);
void lora_registry_unpin(lora_registry_t *r, lora_pin_t *pin);

typedef struct lora_version_info {
    int version;
    lora_state state;
    int refs;                        /* requests holding it */
    bool active;
    bool on_device;                  /* RESIDENT and in a device slot */
    int device_refs;                 /* running sequences using the slot */
} lora_version_info_t;
/* NAME's kept versions, oldest first, into out[0 .. max): returns how many NAME keeps (which
 * may exceed max), or CS_ENOTFOUND. */
int lora_registry_versions(lora_registry_t *r, const char *name, lora_version_info_t *out, int max);

/* Drop a reference from lora_registry_acquire. The last release of a version that is no
 * longer current frees it; of a current one makes it evictable (and may let a waiting load
 * take its room). Thread-safe. */
void lora_registry_release(lora_registry_t *r, lora_ref_t *ref);

/* State and version of NAME's current version (for listings and metrics). CS_ENOTFOUND if
 * NAME is not registered. Either output may be NULL. */
int lora_registry_state(lora_registry_t *r, const char *name, lora_state *st, int *version);

/* What the probe at registration found of version VERSION of NAME (0: the active one): rank,
 * targets and bytes before any load (lora/peft.h). CS_ENOTFOUND; CS_EAGAIN when the probe
 * failed and no load has succeeded yet (the acquire reports why). */
int lora_registry_info(lora_registry_t *r, const char *name, int version, lora_adapter_info_t *info);

/* A device reference to REF's adapter: its slot on the device, uploaded now when it has
 * none (first evicting slots nobody runs on, least recently used first, but only if that
 * makes room). CS_OK with *slot (NULL without a device tier); CS_EAGAIN when there is no
 * room because running sequences use every slot (nothing was evicted: retry when one ends);
 * CS_ENOMEM when the adapter alone exceeds the device budget; an upload error. Held while
 * the caller's sequence runs; one lora_registry_device_release each, before the host
 * reference is released. Engine thread only (the upload runs without the registry lock).
 * A device reference to an adapter still streaming in from disk (stream_host) makes a slot
 * that the loader feeds as its layers come; an adapter that failed part way answers its
 * load's error. */
int lora_registry_device_acquire(lora_registry_t *r, lora_ref_t *ref, backend_adapter_t **slot);
void lora_registry_device_release(lora_registry_t *r, lora_ref_t *ref);
/* CS_OK, or the load's error (cs_error_last names adapter, version and file) when REF's
 * adapter failed part way in from disk (stream_host; lora_adapter_failed says so first). */
int lora_registry_ref_failed(lora_registry_t *r, lora_ref_t *ref);
/* Layers of SLOT (from device_acquire of REF) in place: REF's n_layers once it is complete
 * (always, without streaming). Engine thread; no lock. */
int lora_registry_device_arrived(lora_registry_t *r, lora_ref_t *ref, backend_adapter_t *slot);

typedef struct lora_registry_stats {
    int n_registered;        /* names with a current version */
    int n_resident;          /* adapters in host memory, old versions still held included */
    int n_loading;           /* loads started and not yet finished (waiting for room included) */
    size_t bytes_resident;   /* A/B/Bᵀ bytes of the n_resident adapters */
    uint64_t loads;          /* loads that finished ok */
    uint64_t loads_direct;   /* of those, the ones whose weights came by O_DIRECT */
    uint64_t load_failures;
    uint64_t load_retries;   /* failed loads tried again (LORA_RETRY_MS) */
    uint64_t evictions;      /* resident adapters dropped to make room */
    uint64_t hits;           /* acquires answered CS_OK */
    uint64_t misses;         /* acquires that started a load */
    /* the device tier */
    int n_device;            /* adapters with a device slot */
    size_t device_bytes;     /* device bytes those slots hold */
    uint64_t device_uploads; /* slots made */
    uint64_t device_hits;    /* device acquires that found the slot there */
    uint64_t device_evictions; /* unused slots freed to make room */
    uint64_t device_waits;   /* device acquires answered CS_EAGAIN (every slot running) */
    uint64_t device_streams; /* slots that streamed in completely (stream_group > 0) */
    double device_stream_ms; /* their upload-to-last-layer times, summed */
    uint64_t host_streams;   /* loads whose adapter was handed out while still streaming in
                              * from disk (stream_host: its header read) */
    uint64_t partial_acquires; /* acquires answered CS_OK for an adapter still streaming in */
} lora_registry_stats_t;

/* A consistent snapshot of the counters. */
void lora_registry_stats(lora_registry_t *r, lora_registry_stats_t *st);

/* Name of a state: "on_disk", "loading", "resident", "failed". */
const char *lora_state_name(lora_state st);

#endif
