/*
 * The in-pod bounce copy loop in native threads (csi_pmem/loader/gpu/native.py loads this
 * with ctypes; it uses no Python API and runs with the GIL released).
 *
 * Why native: the Python pipeline (pipeline.py) spends Python work on every chunk
 * (claiming it, the memcpy call, the driver calls, recycling the buffer), shared by a
 * dozen threads through the GIL. That work caps how small a chunk can be: 2 MiB chunks
 * halved its rate on the H200 host, while InstantTensor's native loop moves 2 MiB
 * chunks at 51 GB/s there. Here each worker thread owns a few pinned buffers and runs,
 * without the GIL: claim the next chunk (an atomic counter), wait for the buffer's last
 * transfer (its event) and report that chunk, fill the buffer (memcpy from the
 * mapping), queue the transfer on the one stream and record the buffer's event.
 *
 * Completion: a chunk's index (uint32, native byte order) is written to notify_fd only
 * after its transfer's event has completed, so a tensor is never reported before its
 * bytes are on the device. The caller reads the pipe until EOF.
 *
 * CUDA through the driver API, found in the already loaded libcuda.so.1 (torch and
 * cuda-python load it). fake != 0 replaces the driver for tests without a GPU: "device"
 * addresses are host memory, a transfer is remembered and performed only when its
 * buffer is waited for, so a buffer reused too early shows up as wrong bytes.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#define CU_MEMHOSTREGISTER_PORTABLE 0x01
#define ERR_OTHER (-1)

/* Layouts shared with native.py: every field 8 bytes wide. */
struct csi_piece {
    uint64_t src;     /* offset from job->src_base */
    uint64_t buf_off; /* offset in the pinned buffer */
    uint64_t nbytes;
};

struct csi_chunk {
    uint64_t dst;         /* device address */
    uint64_t nbytes;      /* bytes of the buffer that go to dst */
    uint64_t first_piece; /* index into job->pieces */
    uint64_t npieces;
};

struct csi_job {
    const struct csi_chunk *chunks;
    uint64_t nchunks;
    const struct csi_piece *pieces;
    uint64_t src_base;
    const uint64_t *buffers; /* pinned host addresses, nbuffers of buffer_size */
    uint8_t *ready;          /* per buffer: 1 once faulted in and registered */
    uint64_t nbuffers;
    uint64_t buffer_size;
    const uint64_t *events; /* CUevent per buffer */
    uint64_t stream;        /* CUstream */
    uint64_t ctx;           /* CUcontext made current in every worker */
    uint64_t threads;
    const int64_t *cpus; /* CPUs the workers may run on (ncpus == 0: any) */
    uint64_t ncpus;
    int64_t notify_fd;
    int64_t fake;
    int64_t src_fd;         /* >= 0: read the pieces from this file (offset = src) */
    volatile int64_t stop;  /* set by the caller to cancel: no new chunk is started */
    int64_t error;          /* first failure: a CUresult, -errno, or ERR_OTHER */
    char what[128];         /* what failed */
};

typedef int (*ctx_set_fn)(void *);
typedef int (*memcpy_fn)(uint64_t, const void *, size_t, void *);
typedef int (*event_record_fn)(void *, void *);
typedef int (*event_sync_fn)(void *);
typedef int (*host_register_fn)(void *, size_t, unsigned int);

struct cuda {
    ctx_set_fn ctx_set;
    memcpy_fn memcpy_htod;
    event_record_fn event_record;
    event_sync_fn event_sync;
    host_register_fn host_register;
};

struct fake_transfer {
    uint64_t dst, src, nbytes;
};

struct shared {
    struct csi_job *job;
    struct cuda cu;
    uint64_t next; /* the next unclaimed chunk (atomic) */
    pthread_mutex_t issue;
    pthread_mutex_t failed;
    struct fake_transfer *fake; /* per buffer, fake mode */
};

struct worker {
    struct shared *sh;
    uint64_t index;
};

static void fail(struct shared *sh, int64_t err, const char *what)
{
    struct csi_job *job = sh->job;
    pthread_mutex_lock(&sh->failed);
    if (job->error == 0) {
        job->error = err ? err : ERR_OTHER;
        snprintf(job->what, sizeof job->what, "%s", what);
    }
    pthread_mutex_unlock(&sh->failed);
    __atomic_store_n(&job->stop, 1, __ATOMIC_SEQ_CST);
}

static int stopped(struct csi_job *job)
{
    return __atomic_load_n(&job->stop, __ATOMIC_SEQ_CST) != 0;
}

static int notify(struct shared *sh, uint64_t index)
{
    uint32_t value = (uint32_t)index;
    const char *p = (const char *)&value;
    size_t left = sizeof value; /* below PIPE_BUF: written whole or not at all */
    while (left) {
        ssize_t n = write((int)sh->job->notify_fd, p, left);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            fail(sh, -errno, "writing a chunk's completion to the caller");
            return -1;
        }
        p += n;
        left -= (size_t)n;
    }
    return 0;
}

/* Wait until buffer b's last transfer has landed. */
static int wait_buffer(struct shared *sh, uint64_t b)
{
    struct csi_job *job = sh->job;
    if (job->fake) {
        struct fake_transfer *t = &sh->fake[b];
        if (t->nbytes)
            memcpy((void *)(uintptr_t)t->dst, (const void *)(uintptr_t)t->src, t->nbytes);
        t->nbytes = 0;
        return 0;
    }
    int err = sh->cu.event_sync((void *)(uintptr_t)job->events[b]);
    if (err) {
        fail(sh, err, "cuEventSynchronize (waiting for a bounce buffer's copy)");
        return -1;
    }
    return 0;
}

/* Fault buffer b in and register it, once (the first worker to use it owns it). */
static int prepare(struct shared *sh, uint64_t b)
{
    struct csi_job *job = sh->job;
    if (job->ready[b])
        return 0;
    void *addr = (void *)(uintptr_t)job->buffers[b];
    if (madvise(addr, job->buffer_size, MADV_POPULATE_WRITE) != 0)
        memset(addr, 0, job->buffer_size); /* older kernels: fault it in by writing */
    if (!job->fake) {
        int err = sh->cu.host_register(addr, job->buffer_size, CU_MEMHOSTREGISTER_PORTABLE);
        if (err) {
            fail(sh, err, "cuMemHostRegister of a bounce buffer");
            return -1;
        }
    }
    job->ready[b] = 1;
    return 0;
}

/* pread() the whole piece; 0, or -1 with the job failed. */
static int read_piece(struct shared *sh, char *dst, uint64_t off, uint64_t nbytes)
{
    while (nbytes) {
        ssize_t n = pread((int)sh->job->src_fd, dst, nbytes, (off_t)off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            fail(sh, n < 0 ? -errno : -EIO,
                 n < 0 ? "reading the volume file" : "reading the volume file (it ended early)");
            return -1;
        }
        dst += n;
        off += (uint64_t)n;
        nbytes -= (uint64_t)n;
    }
    return 0;
}

/* Fill buffer b with chunk c's pieces: memcpy from the mapping, or pread() from the
 * file when the caller gave one (a 4 KiB-page file: reading it skips the page faults
 * of a fresh mapping, one per page or fault-around window). */
static int fill(struct shared *sh, uint64_t b, const struct csi_chunk *c)
{
    struct csi_job *job = sh->job;
    const struct csi_piece *p = &job->pieces[c->first_piece];
    char *buf = (char *)(uintptr_t)job->buffers[b];
    for (uint64_t k = 0; k < c->npieces; k++) {
        if (job->src_fd >= 0) {
            if (read_piece(sh, buf + p[k].buf_off, p[k].src, p[k].nbytes))
                return -1;
        } else {
            memcpy(buf + p[k].buf_off, (const char *)(uintptr_t)(job->src_base + p[k].src),
                   p[k].nbytes);
        }
    }
    return 0;
}

static int transfer(struct shared *sh, uint64_t b, const struct csi_chunk *c)
{
    struct csi_job *job = sh->job;
    int rc = 0;
    pthread_mutex_lock(&sh->issue);
    if (job->fake) {
        sh->fake[b].dst = c->dst;
        sh->fake[b].src = job->buffers[b];
        sh->fake[b].nbytes = c->nbytes;
    } else {
        void *stream = (void *)(uintptr_t)job->stream;
        int err = sh->cu.memcpy_htod(c->dst, (const void *)(uintptr_t)job->buffers[b],
                                     c->nbytes, stream);
        if (err) {
            fail(sh, err, "cuMemcpyHtoDAsync of a bounce buffer");
            rc = -1;
        } else if ((err = sh->cu.event_record((void *)(uintptr_t)job->events[b], stream))) {
            fail(sh, err, "cuEventRecord after a bounce buffer's copy");
            rc = -1;
        }
    }
    pthread_mutex_unlock(&sh->issue);
    return rc;
}

static void pin(struct csi_job *job)
{
    if (!job->ncpus)
        return;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (uint64_t i = 0; i < job->ncpus; i++)
        if (job->cpus[i] >= 0 && job->cpus[i] < CPU_SETSIZE)
            CPU_SET((int)job->cpus[i], &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set); /* a hint: ignore errors */
}

static void *work(void *arg)
{
    struct worker *w = arg;
    struct shared *sh = w->sh;
    struct csi_job *job = sh->job;
    uint64_t own[64], pending[64];
    uint64_t nown = 0, slot = 0;
    const uint64_t none = UINT64_MAX;

    pin(job);
    if (!job->fake) {
        int err = sh->cu.ctx_set((void *)(uintptr_t)job->ctx);
        if (err) {
            fail(sh, err, "cuCtxSetCurrent in a bounce thread");
            return NULL;
        }
    }
    for (uint64_t b = w->index; b < job->nbuffers && nown < 64; b += job->threads) {
        own[nown] = b;
        pending[nown++] = none;
    }
    while (nown && !stopped(job)) {
        uint64_t i = __atomic_fetch_add(&sh->next, 1, __ATOMIC_SEQ_CST);
        if (i >= job->nchunks)
            break;
        const struct csi_chunk *c = &job->chunks[i];
        uint64_t b = own[slot];
        if (pending[slot] != none) {
            if (wait_buffer(sh, b) || notify(sh, pending[slot]))
                break;
            pending[slot] = none;
        }
        if (c->nbytes > job->buffer_size) {
            fail(sh, ERR_OTHER, "a chunk larger than its bounce buffer");
            break;
        }
        if (prepare(sh, b))
            break;
        if (fill(sh, b, c))
            break;
        if (transfer(sh, b, c))
            break;
        pending[slot] = i;
        slot = (slot + 1) % nown;
    }
    /* Every transfer this worker queued lands before it returns, reported in order. */
    for (;;) {
        uint64_t best = none, at = 0;
        for (uint64_t k = 0; k < nown; k++)
            if (pending[k] != none && (best == none || pending[k] < best)) {
                best = pending[k];
                at = k;
            }
        if (best == none)
            break;
        pending[at] = none;
        if (wait_buffer(sh, own[at]) == 0 && job->error == 0)
            notify(sh, best);
    }
    return NULL;
}

static int load_cuda(struct cuda *cu)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!lib)
        lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib)
        return -1;
    cu->ctx_set = (ctx_set_fn)dlsym(lib, "cuCtxSetCurrent");
    cu->memcpy_htod = (memcpy_fn)dlsym(lib, "cuMemcpyHtoDAsync_v2");
    cu->event_record = (event_record_fn)dlsym(lib, "cuEventRecord");
    cu->event_sync = (event_sync_fn)dlsym(lib, "cuEventSynchronize");
    cu->host_register = (host_register_fn)dlsym(lib, "cuMemHostRegister_v2");
    return (cu->ctx_set && cu->memcpy_htod && cu->event_record && cu->event_sync &&
            cu->host_register) ? 0 : -1;
}

/*
 * Cuts one target's runs into the job's chunks and pieces: the same windows, in the
 * same order, as chunks.bounce_chunks (tests hold the two to each other). Why here too:
 * planning a 13 GB load in Python objects, then flattening them into this layout,
 * took 7-10 ms of a fresh process's load before its first byte moved; this takes
 * microseconds, with the GIL released.
 *
 * runs: nruns (src, dst, nbytes) triples, dst relative to dst_base; appends at
 * chunks[*nchunks] and pieces[*npieces], which have room for cap entries each
 * (sum of ceil(nbytes / buffer_size) over the runs is always enough). Returns 0, or
 * -1 when buffer_size is 0 or the room is short (nothing past cap is written).
 */
int csi_bounce_plan(const uint64_t *runs, uint64_t nruns, uint64_t buffer_size,
                    uint64_t dst_base, struct csi_chunk *chunks, uint64_t *nchunks,
                    struct csi_piece *pieces, uint64_t *npieces, uint64_t cap)
{
    uint64_t nc = *nchunks, np = *npieces;
    uint64_t open = 0, first = 0, start = 0, end = 0; /* the open window */
    if (!buffer_size)
        return -1;
    for (uint64_t r = 0; r < nruns; r++) {
        uint64_t src = runs[3 * r], dst = runs[3 * r + 1], n = runs[3 * r + 2];
        while (n) {
            uint64_t take = n < buffer_size ? n : buffer_size;
            if (open && dst + take - start > buffer_size) {
                if (nc >= cap)
                    return -1;
                chunks[nc++] = (struct csi_chunk){dst_base + start, end, first, open};
                open = 0;
            }
            if (!open && take == buffer_size) { /* a window of its own */
                if (nc >= cap || np >= cap)
                    return -1;
                chunks[nc++] = (struct csi_chunk){dst_base + dst, take, np, 1};
                pieces[np++] = (struct csi_piece){src, 0, take};
            } else {
                if (!open) {
                    start = dst;
                    end = 0;
                    first = np;
                }
                if (np >= cap)
                    return -1;
                uint64_t off = dst - start;
                pieces[np++] = (struct csi_piece){src, off, take};
                open++;
                if (off + take > end)
                    end = off + take;
            }
            src += take;
            dst += take;
            n -= take;
        }
    }
    if (open) {
        if (nc >= cap)
            return -1;
        chunks[nc++] = (struct csi_chunk){dst_base + start, end, first, open};
    }
    *nchunks = nc;
    *npieces = np;
    return 0;
}

/* Runs the whole job; returns 0, or -1 with job->error and job->what set. */
int csi_bounce_run(struct csi_job *job)
{
    struct shared sh;
    memset(&sh, 0, sizeof sh);
    sh.job = job;
    job->error = 0;
    job->what[0] = 0;
    if (job->threads < 1 || job->nbuffers < 1 || job->buffer_size < 1) {
        snprintf(job->what, sizeof job->what, "need at least one thread and one buffer");
        job->error = ERR_OTHER;
        return -1;
    }
    if (job->threads > job->nbuffers)
        job->threads = job->nbuffers; /* a worker without a buffer has nothing to do */
    if (!job->fake && load_cuda(&sh.cu)) {
        snprintf(job->what, sizeof job->what, "loading libcuda.so.1 (the CUDA driver) and its entry points");
        job->error = ERR_OTHER;
        return -1;
    }
    if (job->fake) {
        sh.fake = calloc(job->nbuffers, sizeof *sh.fake);
        if (!sh.fake) {
            job->error = -ENOMEM;
            snprintf(job->what, sizeof job->what, "allocating the fake device's state");
            return -1;
        }
    }
    pthread_mutex_init(&sh.issue, NULL);
    pthread_mutex_init(&sh.failed, NULL);
    pthread_t *tids = calloc(job->threads, sizeof *tids);
    struct worker *ws = calloc(job->threads, sizeof *ws);
    uint64_t started = 0;
    if (tids && ws) {
        for (; started < job->threads; started++) {
            ws[started].sh = &sh;
            ws[started].index = started;
            int rc = pthread_create(&tids[started], NULL, work, &ws[started]);
            if (rc) {
                fail(&sh, -rc, "starting a bounce thread");
                break;
            }
        }
    } else {
        fail(&sh, -ENOMEM, "allocating the bounce threads");
    }
    for (uint64_t t = 0; t < started; t++)
        pthread_join(tids[t], NULL);
    free(tids);
    free(ws);
    free(sh.fake);
    pthread_mutex_destroy(&sh.issue);
    pthread_mutex_destroy(&sh.failed);
    return job->error ? -1 : 0;
}
