/* One helper thread shared by every kernel of the library (native/kernels.c): a call that
   splits its work runs one half on the caller's thread and the other on the helper, which stays
   alive between calls -- it spins briefly for the next one (a decode step's products and
   attention calls come ~0.1 ms apart), then sleeps on a condition variable. One helper for the
   whole library: two kernels with a thread each would leave one spinning beside the other's
   work on a two-core machine. Started on the first split call (again after a fork). Callers are
   one thread at a time (the inference thread). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#ifndef POOL_SPIN_NS
#define POOL_SPIN_NS 300000L   /* how long the helper spins for the next call before it sleeps */
#endif

typedef void (*pool_fn)(const void *);

static pool_fn pool_task;
static const void *pool_arg;
static atomic_long pool_posted, pool_finished;
static atomic_int pool_sleeping;
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;
static pid_t pool_pid;

static inline void pool_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static long pool_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void *pool_helper(void *arg) {
    long seen = (long)(intptr_t)arg;
    for (;;) {
        long t0 = pool_now_ns();
        int spins = 0;
        while (atomic_load(&pool_posted) == seen) {
            if ((++spins & 255) == 0 && pool_now_ns() - t0 > POOL_SPIN_NS) {
                pthread_mutex_lock(&pool_mu);
                atomic_store(&pool_sleeping, 1);
                while (atomic_load(&pool_posted) == seen) pthread_cond_wait(&pool_cv, &pool_mu);
                atomic_store(&pool_sleeping, 0);
                pthread_mutex_unlock(&pool_mu);
                break;
            }
            pool_relax();
        }
        seen = atomic_load(&pool_posted);
        pool_task(pool_arg);
        atomic_store(&pool_finished, seen);
    }
    return NULL;
}

static int pool_start(void) {
    pid_t me = getpid();
    if (pool_pid == me) return 1;
    pthread_t th;
    atomic_store(&pool_sleeping, 0);
    atomic_store(&pool_finished, atomic_load(&pool_posted));
    if (pthread_create(&th, NULL, pool_helper, (void *)(intptr_t)atomic_load(&pool_posted)) != 0) return 0;
    pthread_detach(th);
    pool_pid = me;
    return 1;
}

/* f(here) on this thread and f(there) on the helper; both done on return (both here, one after
   the other, where no helper can start). */
static void pool_run2(pool_fn f, const void *here, const void *there) {
    if (!pool_start()) { f(here); f(there); return; }
    pool_task = f;
    pool_arg = there;
    long ticket = atomic_load(&pool_posted) + 1;
    atomic_store(&pool_posted, ticket);
    if (atomic_load(&pool_sleeping)) {
        pthread_mutex_lock(&pool_mu);
        pthread_cond_signal(&pool_cv);
        pthread_mutex_unlock(&pool_mu);
    }
    f(here);
    while (atomic_load(&pool_finished) != ticket) pool_relax();
}
