/* The runtime shim's self-check, built with the shim itself (included, so
 * the context's fields are in reach) under ASan/UBSan/TSan by
 * tests/test_containment_runtime.py.  Prints one line per case. */
#include "runtime.c"

#include <stdio.h>

static uint64_t kept;

static int tiles_and_dma(void *in, void *out, void *tm) {
    void *t = xvAllocateBuffer((xvTileManager *)tm, 256, 0, 64);
    int32_t r;
    IDMA_COPY(0, r, in, t, 256);
    IDMA_WAIT(0, r);
    IDMA_COPY(1, r, t, out, 256);
    IDMA_WAIT(1, r);
    int refused = xvAllocateBuffer((xvTileManager *)(uintptr_t)kept, 64, 0, 64) == NULL;
    kept = (uint64_t)(uintptr_t)tm;
    return xvFreeBuffer((xvTileManager *)tm, t) == XVTM_SUCCESS && refused ? 0 : 1;
}

static int mode;

static int breaker(void *in, void *out, void *tm) {
    (void)in, (void)out, (void)tm;
    struct channel *ch = &cur->ch[mode == 1 ? 1 : 0];
    pthread_mutex_lock(&ch->mu); /* as the worker does: the sanitizers judge the shim, not this */
    if (mode == 1) ch->stop = 1;
    if (mode == 2) cur->canary_lo ^= 1;
    if (mode == 3) cur->canary_hi ^= 1;
    if (mode == 4) STORE(ch->done, ch->submitted + 1);
    pthread_mutex_unlock(&ch->mu);
    return 0;
}

int main(void) {
    static uint8_t l2[1 << 16], in[256], out[256];
    for (int i = 0; i < 256; i++)
        in[i] = (uint8_t)i;
    int rv;
    uint64_t el;
    for (int k = 0; k < 2; k++) { /* the second task also tries the first one's handle: stale */
        struct dspx_ctx *c = dspx_rt_new(l2, sizeof l2);
        memset(out, 0, sizeof out);
        int fault = dspx_rt_run(c, tiles_and_dma, in, 256, out, 256, &rv, &el);
        fault = dspx_rt_run(c, tiles_and_dma, in, 256, out, 256, &rv, &el);
        printf("intact rv=%d fault=%d copied=%d broken='%s'\n", rv, fault, !memcmp(in, out, 256), dspx_rt_broken(c));
        dspx_rt_free(c);
    }
    for (mode = 1; mode <= 4; mode++) {
        struct dspx_ctx *c = dspx_rt_new(l2, sizeof l2);
        dspx_rt_run(c, breaker, in, 256, out, 256, &rv, &el);
        printf("mode %d broken='%s'\n", mode, dspx_rt_broken(c));
        /* repair what the case broke, so freeing the context is defined */
        c->canary_lo = c->canary_hi = canary_of(c);
        for (int k = 0; k < DSPX_DMA_CHANNELS; k++) {
            pthread_mutex_lock(&c->ch[k].mu);
            STORE(c->ch[k].done, c->ch[k].submitted);
            STORE(c->ch[k].stop, 0); /* atomic: a worker that saw its stop flag read it unlocked (its thread, never woken, is still waiting) */
            pthread_mutex_unlock(&c->ch[k].mu);
        }
        dspx_rt_free(c);
    }
    return 0;
}
