// The lean forward's decoder layers in one call (worker_svc/lean_stack.py): for a step whose every matmul runs on a
// kernel of this library, the layer loop of lean_model.py's CPU path, call for call, without a Python <-> C crossing
// per op. Built into the CPU kernel library (cpu_build.py).
//
// Why: a lone stream's decode step made ~10 ctypes calls a layer (QKV, rotary, KV write, attention, O, add+norm,
// gate/up, SiLU product, down, add+norm), each with its Python checks, torch.empty and argument conversion: ~1 ms of
// a ~6.5 ms step of the default model on one core, all of it outside the model's arithmetic.
//
// Invariant: the same functions with the same arguments in the same order as the Python loop, so every bit is the
// Python path's (tests/worker/test_lean_stack.py holds the two equal); only the buffers are the caller's scratch,
// reused across layers, instead of one new tensor per op.
#include <cstdint>

extern "C" {
int ps_q_linear_f32(int, const void*, int64_t, int64_t, const void*, int64_t, const void*, void*);
int ps_q_linear_bf16(int, const void*, int64_t, int64_t, const void*, int64_t, const void*, void*);
int ps_q8a_linear_f32(int, const void*, int64_t, int64_t, const void*, int64_t, const void*, void*);
int ps_q8a_linear_bf16(int, const void*, int64_t, int64_t, const void*, int64_t, const void*, void*);
int ps_f32_linear(const void*, int64_t, int64_t, const void*, int64_t, const void*, void*);
int ps_bf16_panel_linear(const void*, int64_t, int64_t, const void*, int64_t, const void*, void*);
int ps_amx_linear_bf16(const void*, int64_t, int64_t, const void*, int64_t, const void*, void*);
void ps_add_rms_norm_f32(void*, const void*, const void*, float, int64_t, int64_t, void*);
void ps_add_rms_norm_bf16(void*, const void*, const void*, float, int64_t, int64_t, void*);
void ps_silu_mul_f32(const void*, int64_t, int64_t, void*);
void ps_silu_mul_bf16(const void*, int64_t, int64_t, void*);
void ps_rope_f32(void*, int64_t, const void*, const void*, int64_t, int64_t, int64_t);
void ps_rope_bf16(void*, int64_t, const void*, const void*, int64_t, int64_t, int64_t);
int ps_write_kv(void*, int64_t, int64_t, const void*, int64_t, const void*, int64_t, const int64_t*, int64_t);
int ps_paged_attention(const void*, int64_t, int64_t, const void*, int, const float*, int, void*, const int64_t*,
                       const int64_t*, const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       float, int64_t, int64_t, int, int, int64_t);
}

namespace {

// A matmul's kernel (lean_stack.py's KINDS).
enum Kind : int64_t { kQuant = 1, kQuantInt8 = 2, kPanels = 3, kAmx = 4 };

// Every field 8 bytes (lean_stack.py mirrors these as ctypes structures of int64 / pointers).
struct Matmul {
  int64_t kind;
  int64_t ggml_type;  // kQuant / kQuantInt8: the weight's GGML type id
  const void* packed;
  int64_t out_features;
  const void* bias;  // null, or out_features values of the model's dtype
};

struct Layer {
  Matmul qkv, o, gate_up, down;
  const void* post_norm;
  const void* next_norm;  // the next layer's input norm; null for the last layer
};

struct Model {
  int64_t bf16;  // 1: bfloat16 activations and pool; 0: float32
  int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
  float eps, scale;
  const Layer* layers;
};

struct Step {
  int64_t num_tokens;
  // the pool [layers, 2, num_blocks, block_size, kv_heads, head_dim], contiguous, of the activations' dtype (its
  // ps_paged_attention Dtype code): layer i's planes at kv + i * kv_layer_bytes
  char* kv;
  int64_t kv_layer_bytes, num_blocks, block_size, pool_dtype;
  const void* cos;  // [T, head_dim], the activations' dtype
  const void* sin;
  const int64_t* slots;  // [T]
  const int64_t* query_start_loc;
  const int64_t* seq_lens;
  const int32_t* block_tables;
  int64_t block_table_stride, num_seqs, q_tile, max_q_len, batch_invariant;
};

// The step's buffers, [T, width] each: x the residual stream (updated in place), h the normed input of the next
// matmul (on entry: layer 0's input norm of x), qkv, attn, proj (O's and down's outputs: O's is consumed by the
// add+norm before down writes), gate_up, act.
struct Scratch {
  void *x, *h, *qkv, *attn, *proj, *gate_up, *act;
};

int matmul(const Matmul& w, bool bf16, const void* x, int64_t m, int64_t k, void* out) {
  switch (w.kind) {
    case kQuant:
      return (bf16 ? ps_q_linear_bf16 : ps_q_linear_f32)(static_cast<int>(w.ggml_type), x, m, k, w.packed,
                                                          w.out_features, w.bias, out);
    case kQuantInt8:
      return (bf16 ? ps_q8a_linear_bf16 : ps_q8a_linear_f32)(static_cast<int>(w.ggml_type), x, m, k, w.packed,
                                                              w.out_features, w.bias, out);
    case kPanels:
      return (bf16 ? ps_bf16_panel_linear : ps_f32_linear)(x, m, k, w.packed, w.out_features, w.bias, out);
    case kAmx:
      return bf16 ? ps_amx_linear_bf16(x, m, k, w.packed, w.out_features, w.bias, out) : 1;
    default:
      return 1;
  }
}

}  // namespace

extern "C" {

// Runs every layer of `model` over the step (see Scratch). On return x holds the residual stream before the last
// layer's down projection is added and proj that projection (the caller adds them: x + down, rounded as torch's add),
// as lean_model.py's loop leaves them. Returns 0; else 100 * (layer + 1) + what failed: 1-4 a matmul (QKV, O,
// gate/up, down), 5 the KV write (a slot out of the pool), 6 attention (shapes the kernel has no instance for).
int ps_lean_stack(const Model* model, const Step* step, const Scratch* s) {
  const bool bf16 = model->bf16 != 0;
  const int64_t t = step->num_tokens, hd = model->head_dim, nh = model->num_heads, nkv = model->num_kv_heads;
  const int64_t width = (nh + 2 * nkv) * hd, elem = bf16 ? 2 : 4, hidden = model->hidden;
  const int64_t inter = model->intermediate, kv_row = nkv * hd * elem;
  char* const qkv = static_cast<char*>(s->qkv);
  for (int64_t i = 0; i < model->num_layers; ++i) {
    const Layer& layer = model->layers[i];
    const int64_t fail = 100 * (i + 1);
    void* const kv = step->kv + i * step->kv_layer_bytes;
    if (matmul(layer.qkv, bf16, s->h, t, hidden, qkv)) return fail + 1;
    // q and k heads side by side, rows `width` apart
    (bf16 ? ps_rope_bf16 : ps_rope_f32)(qkv, width, step->cos, step->sin, t, nh + nkv, hd);
    if (ps_write_kv(kv, step->num_blocks * step->block_size, kv_row, qkv + nh * hd * elem, width * elem,
                    qkv + (nh + nkv) * hd * elem, width * elem, step->slots, t))
      return fail + 5;
    if (ps_paged_attention(qkv, width, hd, kv, static_cast<int>(step->pool_dtype), nullptr, 0, s->attn,
                           step->query_start_loc, step->seq_lens, step->block_tables, step->block_table_stride,
                           step->num_seqs, nh, nkv, hd, step->num_blocks, step->block_size, model->scale,
                           step->q_tile, step->max_q_len, bf16 ? 1 : 0, static_cast<int>(step->batch_invariant), 0))
      return fail + 6;
    if (matmul(layer.o, bf16, s->attn, t, nh * hd, s->proj)) return fail + 2;
    (bf16 ? ps_add_rms_norm_bf16 : ps_add_rms_norm_f32)(s->x, s->proj, layer.post_norm, model->eps, t, hidden, s->h);
    if (matmul(layer.gate_up, bf16, s->h, t, hidden, s->gate_up)) return fail + 3;
    (bf16 ? ps_silu_mul_bf16 : ps_silu_mul_f32)(s->gate_up, t, inter, s->act);
    if (matmul(layer.down, bf16, s->act, t, inter, s->proj)) return fail + 4;
    if (layer.next_norm != nullptr)
      (bf16 ? ps_add_rms_norm_bf16 : ps_add_rms_norm_f32)(s->x, s->proj, layer.next_norm, model->eps, t, hidden,
                                                          s->h);
  }
  return 0;
}

}  // extern "C"
