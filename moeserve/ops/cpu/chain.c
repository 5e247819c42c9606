/* A chain of kernel calls made by one call from Python (ops/cpu/chain.py), through libffi.
 *
 * A decode step calls ~15 kernels a layer, each with its arguments known in advance. From
 * Python each call is a ctypes call that converts its 10-30 arguments again every time, and
 * between two weight streams that runs from cold caches: ~3 us a call. A chain holds the calls
 * (function, argument types and values, each in a 64-bit slot) prepared once as libffi call
 * interfaces and makes them in order, a few nanoseconds apart.
 *
 * Per call: the slot its return value goes to (an argument of a later call: the MoE sort's
 * group count is the expert call's first argument), and what return means a failure (none,
 * nonzero, negative): the chain stops at a failed call and reports its index. The arguments
 * that change every step (positions, cache slots, block tables: "registers") are copied into
 * their slots from the run call's arguments first.
 */
#include <ffi.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { K_I64 = 0, K_I32 = 1, K_PTR = 2, K_F32 = 3 };         /* argument kinds */
enum { R_VOID = -1 };                                          /* return kind: else a K_* */
enum { CHECK_NONE = 0, CHECK_NONZERO = 1, CHECK_NEGATIVE = 2 }; /* what return fails */
#define NREG 6

typedef struct {
    void (*fn)(void);
    ffi_cif cif;
    ffi_type **types;
    void **values;
    int rkind, check;
    int64_t ret_to; /* slot of the return value, or -1 */
} Call;

typedef struct {
    int64_t n, n_slots, n_regs;
    Call *calls;
    uint64_t *slots;
    int64_t *reg_slot, *reg_index; /* slot reg_slot[i] <- register reg_index[i] */
} Chain;

static ffi_type *type_of(int kind) {
    switch (kind) {
    case K_I64: return &ffi_type_sint64;
    case K_I32: return &ffi_type_sint32;
    case K_PTR: return &ffi_type_pointer;
    case K_F32: return &ffi_type_float;
    default: return NULL;
    }
}

void moeserve_chain_free(void *handle) {
    Chain *c = handle;
    if (!c) return;
    if (c->calls)
        for (int64_t i = 0; i < c->n; i++) free(c->calls[i].types), free(c->calls[i].values);
    free(c->calls), free(c->slots), free(c->reg_slot), free(c->reg_index), free(c);
}

/* n calls; call i: function fns[i], nargs[i] arguments whose kinds are the next nargs[i]
 * entries of kinds and whose initial values the next nargs[i] slots of values (a slot holds
 * an int64, a pointer, an int32 or a float's bits in its low bytes), return kind rkinds[i],
 * return slot ret_to[i] (-1: none) and check[i]. Registers: slot reg_slot[j] is set to
 * register reg_index[j] (< NREG) at each run. NULL on a bad kind, a failed ffi_prep_cif or
 * no memory. */
void *moeserve_chain_new(int64_t n, const int64_t *fns, const int64_t *nargs,
                         const int8_t *kinds, const uint64_t *values, const int8_t *rkinds,
                         const int64_t *ret_to, const int8_t *check, int64_t n_regs,
                         const int64_t *reg_slot, const int64_t *reg_index) {
    Chain *c = calloc(1, sizeof(Chain));
    if (!c) return NULL;
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) total += nargs[i];
    c->n = n, c->n_slots = total, c->n_regs = n_regs;
    c->calls = calloc(n ? n : 1, sizeof(Call));
    c->slots = malloc((total ? total : 1) * sizeof(uint64_t));
    c->reg_slot = malloc((n_regs ? n_regs : 1) * sizeof(int64_t));
    c->reg_index = malloc((n_regs ? n_regs : 1) * sizeof(int64_t));
    if (!c->calls || !c->slots || !c->reg_slot || !c->reg_index) goto fail;
    memcpy(c->slots, values, total * sizeof(uint64_t));
    for (int64_t j = 0; j < n_regs; j++) {
        if (reg_slot[j] < 0 || reg_slot[j] >= total || reg_index[j] < 0 || reg_index[j] >= NREG)
            goto fail;
        c->reg_slot[j] = reg_slot[j], c->reg_index[j] = reg_index[j];
    }
    for (int64_t i = 0, first = 0; i < n; first += nargs[i], i++) {
        Call *k = &c->calls[i];
        k->fn = (void (*)(void))(intptr_t)fns[i];
        k->rkind = rkinds[i], k->check = check[i], k->ret_to = ret_to[i];
        k->types = malloc((nargs[i] ? nargs[i] : 1) * sizeof(ffi_type *));
        k->values = malloc((nargs[i] ? nargs[i] : 1) * sizeof(void *));
        if (!k->types || !k->values) goto fail;
        for (int64_t a = 0; a < nargs[i]; a++) {
            k->types[a] = type_of(kinds[first + a]);
            if (!k->types[a]) goto fail;
            k->values[a] = &c->slots[first + a];
        }
        ffi_type *rtype = k->rkind == R_VOID ? &ffi_type_void : type_of(k->rkind);
        const int ret_ok = k->ret_to < 0 || (k->ret_to < total && k->rkind != R_VOID);
        if (!rtype || !ret_ok) goto fail;
        if (ffi_prep_cif(&k->cif, FFI_DEFAULT_ABI, (unsigned)nargs[i], rtype, k->types) != FFI_OK)
            goto fail;
    }
    return c;
fail:
    moeserve_chain_free(c);
    return NULL;
}

/* The chain's slots (to read back or to change between runs). */
uint64_t *moeserve_chain_slots(void *handle) { return ((Chain *)handle)->slots; }

/* Registers r0..r5 into their slots, then every call in order: -1 when all ran, else the
 * index of the call whose return failed its check (the calls after it are not made). */
int64_t moeserve_chain_run(void *handle, int64_t r0, int64_t r1, int64_t r2, int64_t r3,
                           int64_t r4, int64_t r5) {
    Chain *c = handle;
    const int64_t regs[NREG] = {r0, r1, r2, r3, r4, r5};
    for (int64_t j = 0; j < c->n_regs; j++)
        c->slots[c->reg_slot[j]] = (uint64_t)regs[c->reg_index[j]];
    for (int64_t i = 0; i < c->n; i++) {
        Call *k = &c->calls[i];
        ffi_arg ret = 0; /* at least a register wide, as libffi asks */
        ffi_call(&k->cif, k->fn, &ret, k->values);
        int64_t v = 0;
        if (k->rkind == K_I64) v = (int64_t)ret;
        else if (k->rkind == K_I32) v = (int32_t)ret;
        if ((k->check == CHECK_NONZERO && v != 0) || (k->check == CHECK_NEGATIVE && v < 0))
            return i;
        if (k->ret_to >= 0) c->slots[k->ret_to] = (uint64_t)v;
    }
    return -1;
}
