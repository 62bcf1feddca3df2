/* registry.c: adapter names -> versions -> load state, refcounts and the host cache. One
 * mutex guards it all; the disk work runs on the loader thread (lora/loader_uring.c) in two
 * reads per load: adapter_config.json first, which gives the exact F32 size so room is
 * reserved (evicting unheld adapters: those used once first, then the rest, each least
 * recently released first) before the weights are read; a load that finds no room waits in a FIFO until a release or a removal makes
 * some. A freshly loaded adapter is kept for its requester (who retries on on_loaded) for
 * a grace (params.fresh_ms, LORA_FRESH_MS_DEFAULT) before a waiting load may evict it, or two loads could evict each other
 * forever; a loader timer re-runs the wait queue when that grace ends. The loader's
 * callbacks parse and convert outside the mutex. */
#include "lora/registry.h"

#include <limits.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/safetensors.h"
#include "lora/loader_uring.h"


typedef struct lora_entry lora_entry_t;

/* an intrusive doubly linked list */
typedef struct elist { lora_entry_t *head, *tail; } elist_t;
typedef struct elink { lora_entry_t *prev, *next; } elink_t;

/* One version of one name. */
struct lora_entry {
    lora_registry_t *r;
    char *name, *dir;
    int version;
    lora_state state;
    bool kept;              /* one of its name's kept versions (the active one or a pinnable
                             * older/staged one): not freed when unheld, only evicted */
    lora_entry_t *vnext;    /* its name's kept versions, oldest first */
    bool in_io;             /* a loader job points at this entry: it is freed only after */
    bool reserved;          /* counted in used_bytes / used_count */
    bool waiting;           /* on r->waitq (LOADING, config read, no room yet) */
    bool on_lru;            /* on r->lru (RESIDENT, kept, refs == 0) */
    int refs;
    int pins;               /* requests that will acquire exactly this version (lora_registry_pin):
                             * it stays kept (or, dropped by a remove, alive) for them */
    size_t nbytes;          /* A/B/Bᵀ bytes: the F32 bound once adapter_config.json is read, the
                             * bytes held once loaded */
    double fresh_until;     /* cs_time_ms() before which only its requester may take it */
    unsigned uses;          /* acquires that found it in host memory, over its whole life: an
                             * adapter used once is evicted before one used again */
    double load_started;    /* cs_time_ms() when the load from disk began */
    double failed_at;       /* cs_time_ms() of the last failed load */
    /* the device tier: a slot on r->p.device while RESIDENT */
    backend_adapter_t *dslot;
    size_t dbytes;          /* device bytes the slot holds (reserved before the upload) */
    int drefs;              /* running sequences using the slot (lora_registry_device_acquire) */
    bool dbusy;             /* uploading (the lock dropped meanwhile) */
    bool on_dlru;           /* on r->dlru (a slot, drefs == 0) */
    struct dstream *ds;     /* the slot's streaming state (stream_group > 0), freed after it */
    elink_t dq;             /* r->dlru */
    lora_adapter_info_t info; /* rank, targets, bytes: probed at registration, or at the load */
    bool info_known;
    struct hstream *hs;     /* a load streaming in (stream_host): the loader thread's while in_io */
    backend_adapter_t *feed_slot; /* the slot that takes the host layers as they come (under r->smu) */
    void *config;           /* adapter_config.json text between the two reads */
    size_t config_len;
    lora_adapter_t *adapter;
    int err;                /* FAILED: status and message */
    char *errmsg;
    lora_ref_t ref;         /* handed to every acquirer: refs counts them */
    elink_t q;              /* r->lru or r->waitq */
    elink_t all;            /* r->all */
};

typedef struct lora_name {
    struct lora_name *next;
    char *name;
    int last_version;       /* kept after remove, so versions never repeat */
    lora_entry_t *cur;      /* the active version; NULL when removed */
    lora_entry_t *kept;     /* kept versions (cur among them), oldest first */
    int keep;               /* versions to keep (keep_versions; 1 by default) */
} lora_name_t;

struct lora_registry {
    lora_registry_params_t p;
    lora_loader_t *loader;
    pthread_mutex_t mu;
    bool closing;
    bool tick_pending;      /* a loader timer will re-run the wait queue */

    lora_name_t **buckets;
    size_t n_buckets, n_names;

    elist_t all;            /* every live entry */
    elist_t lru;            /* evictable, least recently released at head */
    elist_t waitq;          /* loads waiting for room, oldest at head */
    size_t used_bytes, lru_bytes;
    int used_count, lru_count;
    elist_t dlru;           /* device slots nobody runs on, least recently used at head */
    size_t dused_bytes;     /* device bytes of every slot (and uploads under way) */
    int dused_count;
    lora_registry_stats_t stats;
    pthread_mutex_t smu;    /* the streaming side (the copy thread's; never held around a wait) */
    uint64_t streams;
    double stream_ms;
    struct streamed *sq;    /* slots complete, for on_streamed on the loader thread */
    bool stream_host;       /* p.stream_host, and the device can take a host copy still coming in */
    struct dead_slot *dead; /* slots detached off the engine thread, freed by its next device call */
    bool flush_pending;     /* a loader timer will call flush_streamed */
    bool no_loader;         /* the loader is going: no more timers */
};

static void list_push(elist_t *l, lora_entry_t *e, elink_t *(*link)(lora_entry_t *)) {
    link(e)->prev = l->tail;
    link(e)->next = NULL;
    if (l->tail) link(l->tail)->next = e;
    else l->head = e;
    l->tail = e;
}

static void list_del(elist_t *l, lora_entry_t *e, elink_t *(*link)(lora_entry_t *)) {
    elink_t *k = link(e);
    if (k->prev) link(k->prev)->next = k->next;
    else l->head = k->next;
    if (k->next) link(k->next)->prev = k->prev;
    else l->tail = k->prev;
    k->prev = k->next = NULL;
}

static elink_t *qlink(lora_entry_t *e) { return &e->q; }
static elink_t *dlink(lora_entry_t *e) { return &e->dq; }
static elink_t *alllink(lora_entry_t *e) { return &e->all; }

const char *lora_state_name(lora_state st) {
    switch (st) {
    case LORA_ON_DISK: return "on_disk";
    case LORA_LOADING: return "loading";
    case LORA_RESIDENT: return "resident";
    case LORA_FAILED: return "failed";
    default: return "?";
    }
}

/* ---- names ---- */

static size_t hash_str(const char *s) { return (size_t)cs_hash_str(s); }

static lora_name_t *name_find(const lora_registry_t *r, const char *name) {
    for (lora_name_t *n = r->buckets[hash_str(name) & (r->n_buckets - 1)]; n; n = n->next)
        if (strcmp(n->name, name) == 0) return n;
    return NULL;
}

static lora_name_t *name_get(lora_registry_t *r, const char *name) {
    lora_name_t *n = name_find(r, name);
    if (n) return n;
    if (r->n_names + 1 > 2 * r->n_buckets) {
        size_t nb = r->n_buckets * 4;
        lora_name_t **b = calloc(nb, sizeof *b);
        if (b) {
            for (size_t i = 0; i < r->n_buckets; i++)
                for (lora_name_t *x = r->buckets[i], *nx; x; x = nx) {
                    nx = x->next;
                    size_t h = hash_str(x->name) & (nb - 1);
                    x->next = b[h];
                    b[h] = x;
                }
            free(r->buckets);
            r->buckets = b;
            r->n_buckets = nb;
        } /* else: longer chains, still correct */
    }
    if (!(n = calloc(1, sizeof *n)) || !(n->name = strdup(name))) {
        free(n);
        return NULL;
    }
    size_t h = hash_str(name) & (r->n_buckets - 1);
    n->next = r->buckets[h];
    r->buckets[h] = n;
    r->n_names++;
    return n;
}

/* ---- entries and the cache accounting (all with r->mu held) ---- */

static void set_state(lora_registry_t *r, lora_entry_t *e, lora_state st) {
    if (e->state == LORA_LOADING) r->stats.n_loading--;
    if (e->state == LORA_RESIDENT) {
        r->stats.n_resident--;
        r->stats.bytes_resident -= e->nbytes;
    }
    e->state = st;
    if (st == LORA_LOADING) r->stats.n_loading++;
    if (st == LORA_RESIDENT) {
        r->stats.n_resident++;
        r->stats.bytes_resident += e->nbytes;
    }
}

static void unreserve(lora_registry_t *r, lora_entry_t *e) {
    if (!e->reserved) return;
    r->used_bytes -= e->nbytes;
    r->used_count--;
    e->reserved = false;
}

static void lru_add(lora_registry_t *r, lora_entry_t *e) {
    list_push(&r->lru, e, qlink);
    e->on_lru = true;
    r->lru_bytes += e->nbytes;
    r->lru_count++;
}

static void lru_del(lora_registry_t *r, lora_entry_t *e) {
    if (!e->on_lru) return;
    list_del(&r->lru, e, qlink);
    e->on_lru = false;
    r->lru_bytes -= e->nbytes;
    r->lru_count--;
}

static void wait_del(lora_registry_t *r, lora_entry_t *e) {
    if (!e->waiting) return;
    list_del(&r->waitq, e, qlink);
    e->waiting = false;
}

/* A slot streaming in: the backend's copy thread calls on_group after each layer group.
 * That thread must never wait for a lock: device_drop frees a streaming slot under r->mu
 * (and a server may hold its own lock around a remove), and the free waits for the copy
 * thread. So on_group only counts, queues what it has to tell and arms a loader timer; the
 * loader thread calls on_streamed and on_loaded (smu is never held around a wait). */
typedef struct dstream {
    lora_registry_t *r;
    const char *name;       /* the entry's: it outlives the slot */
    int groups, done;       /* done: atomic */
    double t0;
} dstream_t;

typedef struct streamed {
    struct streamed *next;
    double seconds;
    char name[];
} streamed_t;

static void flush_streamed(void *user) { /* the loader thread */
    lora_registry_t *r = user;
    pthread_mutex_lock(&r->smu);
    streamed_t *q = r->sq;
    r->sq = NULL;
    r->flush_pending = false;
    pthread_mutex_unlock(&r->smu);
    while (q) {
        streamed_t *nx = q->next;
        if (r->p.on_streamed) r->p.on_streamed(r->p.user, q->name, q->seconds);
        free(q);
        q = nx;
    }
    if (r->p.on_loaded) r->p.on_loaded(r->p.user);
}

static void on_group(void *user) {
    dstream_t *ds = user;
    int done = __atomic_add_fetch(&ds->done, 1, __ATOMIC_ACQ_REL);
    lora_registry_t *r = ds->r;
    pthread_mutex_lock(&r->smu);
    if (done == ds->groups) {
        double ms = cs_time_ms() - ds->t0;
        r->streams++;
        r->stream_ms += ms;
        size_t n = strlen(ds->name) + 1;
        streamed_t *t = r->p.on_streamed ? malloc(sizeof *t + n) : NULL;
        if (t) { /* out of memory: the count stays, the metric misses one */
            t->seconds = ms / 1000.0;
            memcpy(t->name, ds->name, n);
            t->next = r->sq;
            r->sq = t;
        }
    }
    if (!r->flush_pending && !r->no_loader)
        r->flush_pending = lora_loader_timer(r->loader, 0, flush_streamed, r) == CS_OK;
    pthread_mutex_unlock(&r->smu);
}

/* Free E's device slot (drefs == 0; r->mu held). Before its host copy goes: a host-memory
 * backend's slot uses that memory in place, and a slot streaming in reads from it.
 * Freeing a slot may wait for the device's compute (a forward may still read it), and a
 * forward may wait for the disk (a layer of an adapter streaming in: the host workers wait
 * for it, on the loader thread): so only the engine thread, between forwards, frees slots
 * (device_room, reap). Anywhere else the slot is detached now and freed by the engine
 * thread's next device call; the returned record then takes the host copy along (host_drop). */
typedef struct dead_slot {
    struct dead_slot *next;
    backend_adapter_t *slot;
    struct dstream *ds;             /* its on_group's user: freed after the slot */
    lora_adapter_t *adapter;        /* the host copy it reads, when that goes too */
} dead_slot_t;

/* E's slot out of the registry's books (r->mu held): no longer on the device LRU, fed or
 * counted; the caller frees it (and its stream state) or defers that */
static void detach(lora_registry_t *r, lora_entry_t *e) {
    CS_ASSERT(e->drefs == 0 && !e->dbusy);
    if (e->on_dlru) {
        list_del(&r->dlru, e, dlink);
        e->on_dlru = false;
    }
    pthread_mutex_lock(&r->smu);
    e->feed_slot = NULL;            /* the loader feeds it no more */
    pthread_mutex_unlock(&r->smu);
    e->dslot = NULL;
    e->ds = NULL;
    r->dused_bytes -= e->dbytes;
    r->dused_count--;
    r->stats.n_device--;
    r->stats.device_bytes -= e->dbytes;
    e->dbytes = 0;
}

/* E's slot freed here: the engine thread between forwards (or out of memory) */
static void device_drop_now(lora_registry_t *r, lora_entry_t *e) {
    if (!e->dslot) return;
    backend_adapter_t *slot = e->dslot;
    struct dstream *ds = e->ds;
    detach(r, e);
    backend_adapter_free(r->p.device, slot); /* waits for copies still streaming into it */
    free(ds);
}

static dead_slot_t *device_drop(lora_registry_t *r, lora_entry_t *e) {
    if (!e->dslot) return NULL;
    dead_slot_t *d = malloc(sizeof *d);
    if (!d) { /* out of memory for a few bytes: free it here, as before */
        device_drop_now(r, e);
        return NULL;
    }
    *d = (dead_slot_t){r->dead, e->dslot, e->ds, NULL};
    r->dead = d;
    detach(r, e);
    return d;
}

/* Free the slots detached elsewhere, and the host copies they read (r->mu held; the engine
 * thread between forwards, or lora_registry_free). */
static void reap(lora_registry_t *r) {
    while (r->dead) {
        dead_slot_t *d = r->dead;
        r->dead = d->next;
        backend_adapter_free(r->p.device, d->slot); /* its copies, then the device's last use */
        free(d->ds);
        lora_adapter_free(d->adapter);
        free(d);
    }
}

/* E's host copy goes (r->mu held): its slot first; a detached slot takes it along */
static void host_drop(lora_registry_t *r, lora_entry_t *e) {
    dead_slot_t *d = device_drop(r, e);
    if (d) d->adapter = e->adapter;
    else lora_adapter_free(e->adapter);
    e->adapter = NULL;
    e->ref.adapter = NULL;
}

static void entry_free(lora_registry_t *r, lora_entry_t *e) {
    list_del(&r->all, e, alllink);
    host_drop(r, e);
    free(e->config);
    free(e->errmsg);
    free(e->name);
    free(e->dir);
    free(e);
}

/* still wanted by its name or by a pinned request (a load of it goes on) */
static bool wanted(const lora_entry_t *e) { return e->kept || e->pins > 0; }

/* Free E if nothing refers to it any more: not kept or pinned, not held, no loader job. */
static void maybe_free(lora_registry_t *r, lora_entry_t *e) {
    if (wanted(e) || e->refs > 0 || e->in_io) return;
    lru_del(r, e);
    wait_del(r, e);
    unreserve(r, e);
    set_state(r, e, LORA_ON_DISK);
    if (r->p.on_dropped && !r->closing) r->p.on_dropped(r->p.user, e->name, e->version, e->dir);
    entry_free(r, e);
}

static void fail(lora_registry_t *r, lora_entry_t *e, int rc, const char *msg) {
    unreserve(r, e);
    wait_del(r, e);
    free(e->config);
    e->config = NULL;
    e->err = rc;
    free(e->errmsg);
    e->errmsg = strdup(msg);
    e->failed_at = cs_time_ms();
    set_state(r, e, LORA_FAILED);
    r->stats.load_failures++;
}

static void pump(lora_registry_t *r);

static void tick(void *user) {
    lora_registry_t *r = user;
    pthread_mutex_lock(&r->mu);
    r->tick_pending = false;
    pump(r);
    pthread_mutex_unlock(&r->mu);
}

/* Reserve E's room, evicting unheld adapters (least recently released first), but only if
 * that is enough: never evict for nothing. Adapters still in their fresh grace are not
 * taken; when only they are in the way, a timer retries when the first grace ends. */
static bool try_reserve(lora_registry_t *r, lora_entry_t *e) {
    size_t cap = r->p.cache_bytes;
    int max = r->p.max_loras;
    double now = cs_time_ms(), first_fresh = 0;
    size_t free_bytes = 0;
    int free_count = 0;
    for (lora_entry_t *v = r->lru.head; v; v = v->q.next) {
        if (v->fresh_until > now) {
            if (!first_fresh || v->fresh_until < first_fresh) first_fresh = v->fresh_until;
            continue;
        }
        free_bytes += v->nbytes;
        free_count++;
    }
    if ((cap && r->used_bytes - free_bytes + e->nbytes > cap) || (max && r->used_count - free_count + 1 > max)) {
        if (first_fresh && !r->tick_pending && !r->closing &&
            (!cap || r->used_bytes - r->lru_bytes + e->nbytes <= cap) && (!max || r->used_count - r->lru_count + 1 <= max) &&
            lora_loader_timer(r->loader, (unsigned)(first_fresh - now) + 1, tick, r) == CS_OK)
            r->tick_pending = true;
        return false;
    }
    /* scan-resistant: the adapters used once go first (least recently released first), then
     * the rest, so that a long tail of adapters asked for once (thousands of tenants) does not
     * push out the ones asked for again and again */
    for (int pass = 0; pass < 2; pass++)
        for (lora_entry_t *v = r->lru.head, *nx; v && ((cap && r->used_bytes + e->nbytes > cap) ||
                                                       (max && r->used_count + 1 > max)); v = nx) {
            nx = v->q.next;
            if (v->fresh_until > now || (pass == 0 && v->uses > 1)) continue;
            CS_ASSERT(v->refs == 0 && v->state == LORA_RESIDENT);
            lru_del(r, v);
            unreserve(r, v);
            set_state(r, v, LORA_ON_DISK);
            host_drop(r, v);
            r->stats.evictions++;
        }
    r->used_bytes += e->nbytes;
    r->used_count++;
    e->reserved = true;
    return true;
}

static void weights_done(void *user, lora_file_t *files, size_t n);
static void weights_chunk(void *user, lora_file_t *file, size_t index, size_t chunk);

/* A load streaming in (stream_host): the loader thread's state, chunk by chunk. */
typedef struct hstream {
    size_t chunk, n_chunks;
    uint8_t *got;           /* [n_chunks]: in */
    safetensors_t *st;      /* the header, over the file's buffer, once its chunks are in */
    lora_adapter_t *a;      /* begun from it (e->adapter once published) */
    size_t *first, *last;   /* [n_layers]: the chunks each layer's tensors take */
    int filled;             /* layers copied into a */
    int rc;                 /* a failure found on the way (the header, a changed file, memory) */
    char msg[1024];
} hstream_t;

static void hstream_free(hstream_t *hs) {
    if (!hs) return;
    safetensors_free(hs->st);
    free(hs->got);
    free(hs->first);
    free(hs->last);
    free(hs);
}

/* Room is reserved: queue the read of the weights. */
static void start_weights(lora_registry_t *r, lora_entry_t *e) {
    char *path = cs_path_join(e->dir, "adapter_model.safetensors");
    const char *paths[1] = { path };
    int rc;
    if (!path) {
        rc = cs_error_set(CS_ENOMEM, "out of memory");
    } else if (r->stream_host) {
        rc = (e->hs = calloc(1, sizeof *e->hs)) ? lora_loader_submit_stream(r->loader, path, weights_chunk, weights_done, e)
                                                : cs_error_set(CS_ENOMEM, "out of memory");
        if (rc) {
            hstream_free(e->hs);
            e->hs = NULL;
        }
    } else {
        rc = lora_loader_submit(r->loader, paths, 1, weights_done, e);
    }
    free(path);
    if (rc != CS_OK) {
        fail(r, e, rc, cs_error_last());
        return;
    }
    e->in_io = true;
}

/* Give room to waiting loads, oldest first. */
static void pump(lora_registry_t *r) {
    while (r->waitq.head && try_reserve(r, r->waitq.head)) {
        lora_entry_t *e = r->waitq.head;
        wait_del(r, e);
        start_weights(r, e);
    }
}

/* E stops being kept (dropped by keep_versions, deleted or removed; the caller unlinked it). */
static void retire(lora_registry_t *r, lora_entry_t *e) {
    e->kept = false;
    if (e->waiting) {
        wait_del(r, e);
        unreserve(r, e);
    }
    maybe_free(r, e);
    pump(r);
}

/* ---- loader callbacks (loader thread) ---- */

static void notify(lora_registry_t *r, bool closing) {
    if (!closing && r->p.on_loaded) r->p.on_loaded(r->p.user);
}

static void config_done(void *user, lora_file_t *files, size_t n) {
    lora_entry_t *e = user;
    lora_registry_t *r = e->r;
    size_t nbytes = 0;
    char msg[1024];
    CS_ASSERT(n == 1);
    int rc = files[0].status;
    if (rc != CS_OK) snprintf(msg, sizeof msg, "%s", files[0].error);
    else if ((rc = lora_adapter_config_nbytes(e->dir, files[0].data, files[0].len, r->p.cfg, &nbytes)) != CS_OK)
        snprintf(msg, sizeof msg, "%s", cs_error_last());
    else if (e->info_known) /* set at registration, before any load: no lock needed to read */
        nbytes = e->info.nbytes; /* exact (the config's figure is the F32 bound) */

    pthread_mutex_lock(&r->mu);
    bool closing = r->closing, finished = true;
    e->in_io = false;
    if (!wanted(e)) {
        maybe_free(r, e);
    } else if (rc != CS_OK) {
        fail(r, e, rc, msg);
    } else if (r->p.cache_bytes && nbytes > r->p.cache_bytes) {
        snprintf(msg, sizeof msg, "%s: needs %zu bytes of A/B weights, more than the whole host cache (%zu bytes)",
                 e->dir, nbytes, r->p.cache_bytes);
        fail(r, e, CS_ENOMEM, msg);
    } else {
        e->config = files[0].data;
        e->config_len = files[0].len;
        files[0].data = NULL;
        e->nbytes = nbytes;
        list_push(&r->waitq, e, qlink);
        e->waiting = true;
        pump(r);
        finished = e->state == LORA_FAILED;   /* the weights' read could not be queued */
    }
    pthread_mutex_unlock(&r->mu);
    if (finished) notify(r, closing);
}

/* Publish the adapter begun from the header (loader thread): acquire may hand it out from
 * now on (stream_host), its layers arriving behind. */
static void publish_begun(lora_registry_t *r, lora_entry_t *e, lora_adapter_t *a) {
    pthread_mutex_lock(&r->mu);
    bool closing = r->closing;
    r->used_bytes -= e->nbytes - a->nbytes; /* without a probe the room reserved was the F32 bound */
    e->nbytes = a->nbytes;
    e->adapter = a;
    e->ref.adapter = a;
    if (!e->info_known) lora_adapter_info(a, &e->info);
    e->info_known = true;
    r->stats.host_streams++;
    pthread_mutex_unlock(&r->mu);
    notify(r, closing); /* waiting requests may start on it */
}

/* As far as the chunks in allow: the header parsed and the adapter begun (its layers' chunks
 * asked for in layer order), then every layer whose chunks are all in copied, and fed to
 * the slot streaming it to the device. Loader thread; takes r->mu only to publish. */
static void stream_advance(lora_registry_t *r, lora_entry_t *e, lora_file_t *f) {
    hstream_t *hs = e->hs;
    if (hs->rc) return;
    const unsigned char *p = f->data;
    if (!hs->st) {
        if (!hs->n_chunks || !hs->got[0] || f->len < 8) return;
        uint64_t hlen = 0;
        for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | p[i];
        size_t need = hlen > f->len - 8 ? f->len : (size_t)hlen + 8; /* too long: the parse says so */
        for (size_t c = 0; c * hs->chunk < need; c++)
            if (!hs->got[c]) return;
        lora_adapter_t *a = NULL;
        int rc = safetensors_open_buffer(f->path, f->data, f->len, false, &hs->st);
        if (rc == CS_OK) rc = lora_adapter_begin(e->name, e->dir, e->config, e->config_len, hs->st, r->p.cfg, r->p.hold_bf16, &a);
        if (rc != CS_OK) {
            hs->rc = rc;
            snprintf(hs->msg, sizeof hs->msg, "%s", cs_error_last());
            return;
        }
        if (a->nbytes > e->nbytes) { /* e->nbytes: only the load's thread writes it now */
            hs->rc = CS_EFORMAT;
            snprintf(hs->msg, sizeof hs->msg, "%s: the adapter's files changed since it was registered (%zu bytes of "
                     "weights now, %zu then): add it again", e->dir, a->nbytes, e->nbytes);
            lora_adapter_free(a);
            return;
        }
        int nl = a->n_layers;
        size_t *order = malloc(sizeof *order * hs->n_chunks);
        if (!(hs->first = malloc(sizeof *hs->first * (size_t)(nl ? nl : 1))) ||
            !(hs->last = malloc(sizeof *hs->last * (size_t)(nl ? nl : 1))) || !order) {
            free(order);
            lora_adapter_free(a);
            hs->rc = CS_ENOMEM;
            snprintf(hs->msg, sizeof hs->msg, "%s: out of memory", e->dir);
            return;
        }
        /* PEFT files hold the layers in name order (0, 1, 10, 11, ..., 2, 20, ...): the reads
         * go layer by layer instead, so layer l is in after about (l + 1) / n of the file */
        size_t n_order = 0;
        for (int l = 0; l < nl; l++) {
            size_t b, en;
            lora_adapter_layer_span(a, hs->st, f->data, l, &b, &en);
            hs->first[l] = b / hs->chunk;
            hs->last[l] = en > b ? (en - 1) / hs->chunk : hs->first[l];
            for (size_t c = hs->first[l]; c <= hs->last[l] && c < hs->n_chunks && n_order < hs->n_chunks; c++)
                if (!n_order || order[n_order - 1] != c) order[n_order++] = c; /* a chunk two layers share: once */
        }
        lora_loader_reorder(f, order, n_order); /* out of memory: file order, no harm */
        free(order);
        hs->a = a;
        publish_begun(r, e, a);
    }
    int nl = hs->a->n_layers;
    while (hs->filled < nl) {
        bool in = true;
        for (size_t c = hs->first[hs->filled]; in && c <= hs->last[hs->filled] && c < hs->n_chunks; c++) in = hs->got[c];
        if (!in) break;
        int rc = lora_adapter_fill_layers(hs->a, hs->st, hs->filled, hs->filled + 1);
        if (rc != CS_OK) {
            hs->rc = rc;
            snprintf(hs->msg, sizeof hs->msg, "%s", cs_error_last());
            return;
        }
        hs->filled++;
        pthread_mutex_lock(&r->smu); /* the device slot takes it at once */
        if (e->feed_slot) backend_adapter_feed(r->p.device, e->feed_slot, hs->filled);
        if (hs->filled == nl) e->feed_slot = NULL;
        pthread_mutex_unlock(&r->smu);
    }
}

static void weights_chunk(void *user, lora_file_t *f, size_t index, size_t chunk) {
    lora_entry_t *e = user;
    hstream_t *hs = e->hs;
    if (!hs->got) {
        hs->chunk = chunk;
        hs->n_chunks = (f->len + chunk - 1) / chunk;
        if (!(hs->got = calloc(hs->n_chunks ? hs->n_chunks : 1, 1))) {
            hs->rc = CS_ENOMEM;
            snprintf(hs->msg, sizeof hs->msg, "%s: out of memory", e->dir);
            return;
        }
    }
    hs->got[index] = 1;
    stream_advance(e->r, e, f);
}

static void weights_done(void *user, lora_file_t *files, size_t n) {
    lora_entry_t *e = user;
    lora_registry_t *r = e->r;
    lora_adapter_t *a = NULL;
    char msg[1024];
    double load_s = -1;
    char lname[128] = "";
    CS_ASSERT(n == 1);
    int rc = files[0].status;
    bool direct = files[0].direct;
    hstream_t *hs = e->hs;
    bool published = hs && hs->a;   /* requests may hold it already */
    if (rc != CS_OK) {
        snprintf(msg, sizeof msg, "%s", files[0].error);
    } else if (hs) {
        /* every chunk is in: what the chunks left (an empty file, a header never complete) */
        if (!hs->got && files[0].len) {
            hs->chunk = files[0].len;
            hs->n_chunks = 1;
            hs->got = calloc(1, 1);
        }
        if (hs->got) memset(hs->got, 1, hs->n_chunks);
        if (hs->got || !files[0].len) stream_advance(r, e, &files[0]);
        published = hs->a != NULL;
        if (!hs->rc && !hs->a) { /* a file too short for a header: the parse's message */
            safetensors_t *st = NULL;
            hs->rc = safetensors_open_buffer(files[0].path, files[0].data, files[0].len, false, &st);
            if (!hs->rc) hs->rc = cs_error_set(CS_EFORMAT, "%s: no header", files[0].path);
            snprintf(hs->msg, sizeof hs->msg, "%s", cs_error_last());
            safetensors_free(st);
        }
        if ((rc = hs->rc) != CS_OK) snprintf(msg, sizeof msg, "%s", hs->msg);
        else a = hs->a;
    } else {
        /* e->config, name and dir are this load's alone until in_io is cleared */
        safetensors_t *st = NULL;
        /* borrowed: the tensors are copied out, and the loader reuses the buffer afterwards */
        rc = safetensors_open_buffer(files[0].path, files[0].data, files[0].len, false, &st);
        if (rc == CS_OK)
            rc = lora_adapter_load_buffers(e->name, e->dir, e->config, e->config_len, st, r->p.cfg, r->p.hold_bf16, &a);
        if (rc != CS_OK) snprintf(msg, sizeof msg, "%s", cs_error_last());
        safetensors_free(st);
    }
    if (hs && hs->a && hs->filled == hs->a->n_layers && rc != CS_OK && !hs->rc) {
        rc = CS_OK; /* every byte was in and used: a later error (the close) changes nothing */
        a = hs->a;
    }
    lora_adapter_t *pa = published ? hs->a : NULL;
    if (hs) {
        hstream_free(hs);
        e->hs = NULL;
    }

    pthread_mutex_lock(&r->mu);
    bool closing = r->closing;
    e->in_io = false;
    free(e->config);
    e->config = NULL;
    if (!published && !wanted(e)) {
        lora_adapter_free(a);
        maybe_free(r, e);
        pump(r);
    } else if (!published && rc == CS_OK && a->nbytes > e->nbytes) { /* changed on disk since registration */
        snprintf(msg, sizeof msg, "%s: the adapter's files changed since it was registered (%zu bytes of weights "
                 "now, %zu then): add it again", e->dir, a->nbytes, e->nbytes);
        lora_adapter_free(a);
        fail(r, e, CS_EFORMAT, msg);
        pump(r);
    } else if (rc != CS_OK) {
        fail(r, e, rc, msg);
        if (pa) lora_adapter_host_fail(pa); /* its holders' waits end; they fail, with msg */
        if (pa && e->refs == 0) host_drop(r, e); /* nobody holds the part that came: it goes */
        if (!wanted(e)) maybe_free(r, e);
        pump(r);
    } else {
        if (!published) {
            /* without a probe the room reserved was the F32 bound: BF16 weights give half back */
            CS_ASSERT(e->refs == 0);
            r->used_bytes -= e->nbytes - a->nbytes;
            e->nbytes = a->nbytes;
            e->adapter = a;
            e->ref.adapter = a;
            if (!e->info_known) lora_adapter_info(a, &e->info);
            e->info_known = true;
        }
        set_state(r, e, LORA_RESIDENT);
        e->fresh_until = cs_time_ms() + (r->p.fresh_ms > 0 ? r->p.fresh_ms : LORA_FRESH_MS_DEFAULT);
        if (e->kept && e->refs == 0) lru_add(r, e); /* a dropped, pinned one waits for its pinners, unevictable */
        r->stats.loads++;
        r->stats.loads_direct += direct;
        load_s = (cs_time_ms() - e->load_started) / 1000.0;
        snprintf(lname, sizeof lname, "%s", e->name);
        if (!wanted(e)) maybe_free(r, e);
        pump(r);    /* at worst, arms the timer for when its grace ends */
    }
    pthread_mutex_unlock(&r->mu);
    if (load_s >= 0 && !closing && r->p.on_load_time) r->p.on_load_time(r->p.user, lname, load_s);
    notify(r, closing);
}

/* ---- API ---- */

int lora_registry_new(const lora_registry_params_t *p, lora_registry_t **out) {
    int rc;
    *out = NULL;
    if (!p || !p->cfg || p->max_loras < 0) return cs_error_set(CS_EINVAL, "lora registry: bad parameters");
    lora_registry_t *r = calloc(1, sizeof *r);
    if (!r) return cs_error_set(CS_ENOMEM, "lora registry: out of memory");
    r->p = *p;
    r->stream_host = p->stream_host && p->stream_group > 0 && p->device && backend_caps(p->device)->adapter_feed;
    pthread_mutex_init(&r->mu, NULL);
    pthread_mutex_init(&r->smu, NULL);
    r->n_buckets = 64;
    if (!(r->buckets = calloc(r->n_buckets, sizeof *r->buckets))) {
        rc = cs_error_set(CS_ENOMEM, "lora registry: out of memory");
        goto err;
    }
    lora_loader_params_t lp = {.buffered = p->buffered_io};
    if ((rc = lora_loader_init(&lp, &r->loader)) != CS_OK) goto err;
    *out = r;
    return CS_OK;
err:
    lora_registry_free(r);
    return rc;
}

void lora_registry_free(lora_registry_t *r) {
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    r->closing = true;
    pthread_mutex_unlock(&r->mu);
    pthread_mutex_lock(&r->smu);
    r->no_loader = true;            /* slots still streaming in arm no timer from now on */
    pthread_mutex_unlock(&r->smu);
    lora_loader_free(r->loader);    /* the callbacks of unfinished loads run here */
    while (r->all.head) {
        lora_entry_t *e = r->all.head;
        CS_ASSERT(e->refs == 0 && e->drefs == 0 && !e->in_io);
        entry_free(r, e);
    }
    reap(r);
    for (size_t i = 0; r->buckets && i < r->n_buckets; i++)
        for (lora_name_t *n = r->buckets[i], *nx; n; n = nx) {
            nx = n->next;
            free(n->name);
            free(n);
        }
    free(r->buckets);
    for (streamed_t *t = r->sq, *nx; t; t = nx) {
        nx = t->next;
        free(t);
    }
    pthread_mutex_destroy(&r->mu);
    pthread_mutex_destroy(&r->smu);
    free(r);
}

/* the kept entry of N with this version (0: the active one), or NULL */
static lora_entry_t *kept_find(const lora_name_t *n, int version) {
    if (!n) return NULL;
    if (version == 0) return n->cur;
    for (lora_entry_t *e = n->kept; e; e = e->vnext)
        if (e->version == version) return e;
    return NULL;
}

static void kept_unlink(lora_name_t *n, lora_entry_t *e) {
    for (lora_entry_t **p = &n->kept; *p; p = &(*p)->vnext)
        if (*p == e) {
            *p = e->vnext;
            e->vnext = NULL;
            return;
        }
}

/* Keep at most n->keep versions: drop the oldest ones that are neither active nor SPARE
 * (the version just added). Dropped versions live on while requests hold them. */
static void kept_trim(lora_registry_t *r, lora_name_t *n, const lora_entry_t *spare) {
    int count = 0;
    for (lora_entry_t *e = n->kept; e; e = e->vnext) count++;
    for (lora_entry_t *e = n->kept, *nx; e && count > n->keep; e = nx) {
        nx = e->vnext;
        if (e == n->cur || e == spare || e->pins > 0) continue; /* pinned requests wait for it */
        kept_unlink(n, e);
        retire(r, e);
        count--;
    }
}

/* "3, 4, 7" for error messages */
static void kept_list(const lora_name_t *n, char *buf, size_t len) {
    size_t o = 0;
    buf[0] = 0;
    for (const lora_entry_t *e = n ? n->kept : NULL; e && o < len; e = e->vnext)
        o += (size_t)snprintf(buf + o, len - o, "%s%d", o ? ", " : "", e->version);
    if (!buf[0]) snprintf(buf, len, "none");
}

static int add(lora_registry_t *r, const char *name, const char *dir, int want, bool activate, int keep, int *version) {
    if (!name || !name[0] || !dir || !dir[0])
        return cs_error_set(CS_EINVAL, "lora registry: an adapter needs a name and a directory");
    if (keep < 0) return cs_error_set(CS_EINVAL, "adapter '%s': keep_versions must be at least 1", name);
    lora_entry_t *e = calloc(1, sizeof *e);
    if (!e || !(e->name = strdup(name)) || !(e->dir = strdup(dir))) {
        if (e) free(e->name);
        free(e);
        return cs_error_set(CS_ENOMEM, "adapter '%s': out of memory", name);
    }
    e->r = r;
    e->state = LORA_ON_DISK;
    e->kept = true;
    e->ref.name = e->name;
    /* rank, targets, dtype and exact bytes from the config and the safetensors header, read
     * now (a few KB; no lock held). A probe that fails leaves them unknown: the load then
     * reserves the F32 bound, and reports the error when the version is acquired. */
    e->info_known = lora_adapter_probe(dir, r->p.cfg, r->p.hold_bf16, &e->info) == CS_OK;
    cs_error_clear();

    pthread_mutex_lock(&r->mu);
    lora_name_t *n = name_get(r, name);
    int rc = CS_OK;
    if (!n) rc = cs_error_set(CS_ENOMEM, "adapter '%s': out of memory", name);
    else if (want > 0 && want <= n->last_version)
        rc = cs_error_set(CS_EINVAL, "adapter '%s': version %d is not newer than version %d", name, want, n->last_version);
    else if (!activate && !n->cur)
        rc = cs_error_set(CS_EINVAL, "adapter '%s' has no active version: its first version must be activated", name);
    if (rc) {
        pthread_mutex_unlock(&r->mu);
        free(e->name);
        free(e->dir);
        free(e);
        return rc;
    }
    e->version = e->ref.version = n->last_version = want > 0 ? want : n->last_version + 1;
    list_push(&r->all, e, alllink);
    lora_entry_t **tail = &n->kept;
    while (*tail) tail = &(*tail)->vnext;
    *tail = e;
    if (!n->keep) n->keep = 1;
    if (keep) n->keep = keep;
    if (activate) {
        if (!n->cur) r->stats.n_registered++;
        n->cur = e;
    }
    kept_trim(r, n, e);
    pthread_mutex_unlock(&r->mu);
    if (version) *version = e->version;
    return CS_OK;
}

int lora_registry_add(lora_registry_t *r, const char *name, const char *dir, int *version) {
    return add(r, name, dir, 0, true, 0, version);
}

int lora_registry_add_ex(lora_registry_t *r, const char *name, const char *dir, int version, bool activate,
                         int keep_versions, int *out_version) {
    if (version < 0) return cs_error_set(CS_EINVAL, "adapter '%s': versions start at 1", name);
    return add(r, name, dir, version, activate, keep_versions, out_version);
}

int lora_registry_activate(lora_registry_t *r, const char *name, int version, int keep_versions, char *dir,
                           size_t dirlen) {
    char kl[256];
    pthread_mutex_lock(&r->mu);
    lora_name_t *n = name_find(r, name);
    lora_entry_t *e = version > 0 ? kept_find(n, version) : NULL;
    if (!e) {
        kept_list(n, kl, sizeof kl);
        pthread_mutex_unlock(&r->mu);
        return cs_error_set(CS_ENOTFOUND, "adapter '%s' has no version %d (kept: %s)", name, version, kl);
    }
    if (!n->cur) r->stats.n_registered++;
    n->cur = e;
    if (keep_versions > 0) n->keep = keep_versions;
    if (dir) snprintf(dir, dirlen, "%s", e->dir);
    kept_trim(r, n, NULL);
    pthread_mutex_unlock(&r->mu);
    return CS_OK;
}

int lora_registry_remove_version(lora_registry_t *r, const char *name, int version) {
    char kl[256];
    int rc = CS_OK;
    pthread_mutex_lock(&r->mu);
    lora_name_t *n = name_find(r, name);
    lora_entry_t *e = version > 0 ? kept_find(n, version) : NULL;
    if (!e) {
        kept_list(n, kl, sizeof kl);
        rc = cs_error_set(CS_ENOTFOUND, "adapter '%s' has no version %d (kept: %s)", name, version, kl);
    } else if (e == n->cur) {
        rc = cs_error_set(CS_EBUSY, "version %d is the active version of '%s'", version, name);
    } else if (e->refs + e->pins > 0) {
        rc = cs_error_set(CS_EBUSY, "version %d of '%s' is in use by %d request%s", version, name, e->refs + e->pins,
                          e->refs + e->pins == 1 ? "" : "s");
    } else {
        kept_unlink(n, e);
        retire(r, e);
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

int lora_registry_remove(lora_registry_t *r, const char *name) {
    pthread_mutex_lock(&r->mu);
    lora_name_t *n = name_find(r, name);
    if (!n || !n->cur) {
        pthread_mutex_unlock(&r->mu);
        return cs_error_set(CS_ENOTFOUND, "adapter '%s' is not registered", name);
    }
    n->cur = NULL;
    r->stats.n_registered--;
    while (n->kept) {
        lora_entry_t *e = n->kept;
        kept_unlink(n, e);
        retire(r, e);
    }
    pthread_mutex_unlock(&r->mu);
    return CS_OK;
}

int lora_registry_acquire(lora_registry_t *r, const char *name, lora_ref_t **out) {
    return lora_registry_acquire_version(r, name, 0, out);
}

/* take a reference to E (r->mu held): see lora_registry_acquire */
static int acquire_entry(lora_registry_t *r, lora_entry_t *e, lora_ref_t **out) {
    int rc = CS_OK;
    const char *name = e->name;
    switch (e->state) {
    case LORA_RESIDENT:
        if (e->refs++ == 0) lru_del(r, e);
        if (e->uses < UINT_MAX) e->uses++;
        e->fresh_until = 0;
        r->stats.hits++;
        *out = &e->ref;
        break;
    case LORA_LOADING:
        if (e->adapter) { /* streaming in from disk (stream_host): its layers follow */
            e->refs++;
            r->stats.partial_acquires++;
            *out = &e->ref;
            break;
        }
        rc = cs_error_set(CS_EAGAIN, e->waiting ? "adapter '%s' version %d waits for room in the host cache "
                                                  "(every cached adapter is in use)"
                                                : "adapter '%s' version %d is loading", name, e->version);
        break;
    case LORA_FAILED:
        /* The disk's failures pass (a read error, a file missing, memory short): the load is
         * tried again by the first request LORA_RETRY_MS after it failed; the requests in
         * between fail at once with its error. A file whose content is wrong stays failed
         * (its version is what it is: push or load a new one). */
        if ((e->err == CS_EIO || e->err == CS_ENOTFOUND || e->err == CS_ENOMEM) && !e->adapter &&
            cs_time_ms() - e->failed_at >= LORA_RETRY_MS) { /* (not while the part that came is held) */
            set_state(r, e, LORA_ON_DISK);
            r->stats.load_retries++;
            goto on_disk;
        }
        rc = cs_error_set(e->err, "adapter '%s' version %d: %s", name, e->version,
                          e->errmsg ? e->errmsg : cs_strerror(e->err));
        break;
    case LORA_ON_DISK:
    on_disk: {
        char *path = cs_path_join(e->dir, "adapter_config.json");
        const char *paths[1] = { path };
        rc = path ? lora_loader_submit(r->loader, paths, 1, config_done, e) : cs_error_set(CS_ENOMEM, "out of memory");
        free(path);
        if (rc != CS_OK) {
            rc = cs_error_set(rc, "adapter '%s' version %d: cannot start loading: %s", name, e->version, cs_error_last());
            break;
        }
        e->in_io = true;
        e->load_started = cs_time_ms();
        set_state(r, e, LORA_LOADING);
        r->stats.misses++;
        rc = cs_error_set(CS_EAGAIN, "adapter '%s' version %d is loading", name, e->version);
        break;
    }
    }
    return rc;
}

/* Under r->mu: the error for a name (n, found by name_find) without the version asked for:
 * not registered, or the version not among those kept. */
static int not_kept_error(lora_name_t *n, const char *name, int version) {
    if (!n || !n->cur) return cs_error_set(CS_ENOTFOUND, "adapter '%s' is not registered", name);
    char kl[256];
    kept_list(n, kl, sizeof kl);
    return cs_error_set(CS_ENOTFOUND, "adapter '%s' version %d is not kept (kept versions: %s)", name, version, kl);
}

int lora_registry_acquire_version(lora_registry_t *r, const char *name, int version, lora_ref_t **out) {
    int rc;
    *out = NULL;
    pthread_mutex_lock(&r->mu);
    lora_name_t *n = name_find(r, name);
    lora_entry_t *e = n && n->cur ? kept_find(n, version) : NULL;
    if (!e) {
        rc = not_kept_error(n, name, version);
    } else {
        rc = acquire_entry(r, e, out);
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

int lora_registry_pin(lora_registry_t *r, const char *name, int version, lora_pin_t **out) {
    int rc = CS_OK;
    *out = NULL;
    pthread_mutex_lock(&r->mu);
    lora_name_t *n = name_find(r, name);
    lora_entry_t *e = n && n->cur && version > 0 ? kept_find(n, version) : NULL;
    if (!e) {
        rc = not_kept_error(n, name, version);
    } else {
        e->pins++;
        *out = (lora_pin_t *)e;
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

int lora_registry_acquire_pinned(lora_registry_t *r, lora_pin_t *pin, lora_ref_t **out) {
    lora_entry_t *e = (lora_entry_t *)pin;
    *out = NULL;
    pthread_mutex_lock(&r->mu);
    CS_ASSERT(e->r == r && e->pins > 0);
    int rc = acquire_entry(r, e, out);
    pthread_mutex_unlock(&r->mu);
    return rc;
}

void lora_registry_unpin(lora_registry_t *r, lora_pin_t *pin) {
    if (!pin) return;
    lora_entry_t *e = (lora_entry_t *)pin;
    pthread_mutex_lock(&r->mu);
    CS_ASSERT(e->r == r && e->pins > 0);
    if (--e->pins == 0 && !e->kept) {
        maybe_free(r, e);
        pump(r);
    }
    pthread_mutex_unlock(&r->mu);
}


void lora_registry_release(lora_registry_t *r, lora_ref_t *ref) {
    if (!ref) return;
    lora_entry_t *e = (lora_entry_t *)((char *)ref - offsetof(lora_entry_t, ref));
    pthread_mutex_lock(&r->mu);
    CS_ASSERT(e->r == r && e->refs > 0 && e->adapter);
    CS_ASSERT(e->refs > 1 || e->drefs == 0); /* device references end before the last host one */
    if (--e->refs == 0) {
        if (e->state == LORA_FAILED) { /* failed part way in: what came goes */
            host_drop(r, e);
            maybe_free(r, e);
        } else if (e->state == LORA_RESIDENT && e->kept) {
            lru_add(r, e);
        } else {
            maybe_free(r, e); /* streaming in (in_io): later */
        }
        pump(r);
    }
    pthread_mutex_unlock(&r->mu);
}

int lora_registry_state(lora_registry_t *r, const char *name, lora_state *st, int *version) {
    int rc = CS_OK;
    pthread_mutex_lock(&r->mu);
    lora_name_t *n = name_find(r, name);
    if (!n || !n->cur) {
        rc = cs_error_set(CS_ENOTFOUND, "adapter '%s' is not registered", name);
    } else {
        if (st) *st = n->cur->state;
        if (version) *version = n->cur->version;
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

/* ---- the device tier ---- */

static lora_entry_t *entry_of(lora_registry_t *r, lora_ref_t *ref) {
    lora_entry_t *e = (lora_entry_t *)((char *)ref - offsetof(lora_entry_t, ref));
    CS_ASSERT(e->r == r && e->refs > 0 && e->adapter);
    return e;
}

/* room for NBYTES more and one more slot, evicting unused slots (least recently used first),
 * but only if that is enough: never evict for nothing (r->mu held) */
static bool device_room(lora_registry_t *r, size_t nbytes) {
    size_t cap = r->p.device_bytes, free_bytes = 0;
    int max = r->p.device_slots, free_count = 0;
    for (lora_entry_t *v = r->dlru.head; v; v = v->dq.next) {
        free_bytes += v->dbytes;
        free_count++;
    }
    if ((cap && r->dused_bytes - free_bytes + nbytes > cap) || (max && r->dused_count - free_count + 1 > max))
        return false;
    while (r->dlru.head && ((cap && r->dused_bytes + nbytes > cap) || (max && r->dused_count + 1 > max))) {
        device_drop_now(r, r->dlru.head); /* the engine thread: its memory before the new slot's */
        r->stats.device_evictions++;
    }
    return true;
}

int lora_registry_device_acquire(lora_registry_t *r, lora_ref_t *ref, backend_adapter_t **slot) {
    *slot = NULL;
    if (!r->p.device) return CS_OK;
    pthread_mutex_lock(&r->mu);
    reap(r);
    lora_entry_t *e = entry_of(r, ref);
    CS_ASSERT(!e->dbusy); /* one caller (the engine thread) */
    if (e->state == LORA_FAILED) { /* it failed part way in from disk */
        int rc = cs_error_set(e->err, "adapter '%s' version %d: %s", e->name, e->version,
                              e->errmsg ? e->errmsg : cs_strerror(e->err));
        pthread_mutex_unlock(&r->mu);
        return rc;
    }
    if (e->dslot) {
        if (e->on_dlru) {
            list_del(&r->dlru, e, dlink);
            e->on_dlru = false;
        }
        e->drefs++;
        r->stats.device_hits++;
        *slot = e->dslot;
        pthread_mutex_unlock(&r->mu);
        return CS_OK;
    }
    size_t want = e->adapter->nbytes; /* what a copy takes; the real figure once uploaded */
    if (r->p.device_bytes && want > r->p.device_bytes) {
        pthread_mutex_unlock(&r->mu);
        return cs_error_set(CS_ENOMEM, "adapter '%s' version %d: %zu bytes of weights, more than the whole device "
                            "adapter budget (%zu bytes)", e->name, e->version, want, r->p.device_bytes);
    }
    if (!device_room(r, want)) {
        r->stats.device_waits++;
        pthread_mutex_unlock(&r->mu);
        return CS_EAGAIN;
    }
    r->dused_bytes += want;
    r->dused_count++;
    e->dbusy = true;
    pthread_mutex_unlock(&r->mu);

    /* the upload without the lock: the held reference keeps the host copy alive */
    backend_adapter_t *s = NULL;
    dstream_t *ds = NULL;
    int rc;
    if (r->p.stream_group > 0 && backend_caps(r->p.device)->adapter_stream) {
        ds = calloc(1, sizeof *ds);
        if (!ds) {
            rc = cs_error_set(CS_ENOMEM, "out of memory");
        } else {
            *ds = (dstream_t){r, e->name, (e->adapter->n_layers + r->p.stream_group - 1) / r->p.stream_group, 0,
                              cs_time_ms()};
            if (ds->groups < 1) ds->groups = 1;
            rc = lora_adapter_stream(e->adapter, r->p.device, r->p.stream_group, on_group, ds, &s);
        }
    } else {
        rc = lora_adapter_upload(e->adapter, r->p.device, &s);
    }
    size_t got = rc == CS_OK ? backend_adapter_bytes(r->p.device, s) : 0;
    if (rc == CS_OK && ds && r->stream_host) {
        /* a host copy still streaming in from disk when the slot was made took what was
         * there then: the loader feeds it the rest as layers come, and this what came since
         * (feeding what a slot has is nothing) */
        pthread_mutex_lock(&r->smu);
        uint32_t h = cs_flag_load(&e->adapter->host_layers);
        if (h != LORA_HOST_FAILED) backend_adapter_feed(r->p.device, s, (int)h);
        if (h < (uint32_t)e->adapter->n_layers) e->feed_slot = s;
        pthread_mutex_unlock(&r->smu);
    }

    pthread_mutex_lock(&r->mu);
    e->dbusy = false;
    r->dused_bytes -= want;
    if (rc == CS_OK) {
        e->dslot = s;
        e->ds = ds;
        ds = NULL;
        e->dbytes = got;
        e->drefs = 1;
        r->dused_bytes += got;
        r->stats.n_device++;
        r->stats.device_bytes += got;
        r->stats.device_uploads++;
        *slot = s;
    } else {
        r->dused_count--;
    }
    pthread_mutex_unlock(&r->mu);
    free(ds);
    return rc;
}

int lora_registry_device_arrived(lora_registry_t *r, lora_ref_t *ref, backend_adapter_t *slot) {
    int n = ref->adapter->n_layers;
    if (!r->p.device || !slot) return n;
    int a = backend_adapter_arrived(r->p.device, slot);
    return a < n ? a : n;
}

void lora_registry_device_release(lora_registry_t *r, lora_ref_t *ref) {
    if (!r->p.device) return;
    pthread_mutex_lock(&r->mu);
    reap(r);
    lora_entry_t *e = entry_of(r, ref);
    CS_ASSERT(e->dslot && e->drefs > 0);
    if (--e->drefs == 0) {
        list_push(&r->dlru, e, dlink);
        e->on_dlru = true;
    }
    pthread_mutex_unlock(&r->mu);
}

int lora_registry_ref_failed(lora_registry_t *r, lora_ref_t *ref) {
    pthread_mutex_lock(&r->mu);
    lora_entry_t *e = entry_of(r, ref);
    int rc = e->state != LORA_FAILED ? CS_OK
                                     : cs_error_set(e->err, "adapter '%s' version %d: %s", e->name, e->version,
                                                    e->errmsg ? e->errmsg : cs_strerror(e->err));
    pthread_mutex_unlock(&r->mu);
    return rc;
}

int lora_registry_info(lora_registry_t *r, const char *name, int version, lora_adapter_info_t *info) {
    int rc = CS_OK;
    pthread_mutex_lock(&r->mu);
    lora_name_t *n = name_find(r, name);
    lora_entry_t *e = !n || !n->cur ? NULL : version > 0 ? kept_find(n, version) : n->cur;
    if (!e) rc = cs_error_set(CS_ENOTFOUND, "adapter '%s' has no %s", name, version > 0 ? "such version" : "active version");
    else if (!e->info_known) rc = cs_error_set(CS_EAGAIN, "adapter '%s' version %d: not known before its load", name, e->version);
    else *info = e->info;
    pthread_mutex_unlock(&r->mu);
    return rc;
}

int lora_registry_versions(lora_registry_t *r, const char *name, lora_version_info_t *out, int max) {
    int count = 0;
    pthread_mutex_lock(&r->mu);
    lora_name_t *n = name_find(r, name);
    if (!n || !n->cur) {
        pthread_mutex_unlock(&r->mu);
        return cs_error_set(CS_ENOTFOUND, "adapter '%s' is not registered", name);
    }
    for (lora_entry_t *e = n->kept; e; e = e->vnext, count++)
        if (count < max) out[count] = (lora_version_info_t){e->version, e->state, e->refs, e == n->cur, e->dslot != NULL, e->drefs};
    pthread_mutex_unlock(&r->mu);
    return count;
}

void lora_registry_stats(lora_registry_t *r, lora_registry_stats_t *st) {
    pthread_mutex_lock(&r->mu);
    *st = r->stats;
    pthread_mutex_unlock(&r->mu);
    pthread_mutex_lock(&r->smu);
    st->device_streams = r->streams;
    st->device_stream_ms = r->stream_ms;
    pthread_mutex_unlock(&r->smu);
}
