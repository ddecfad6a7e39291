// The compiled engine: kernels of ours at the autocast dispatch key, in C++.
//
// What Python decides and what this file executes (docs/design.md, "The compiled engine"):
// the policy and its plan are Python. For each aten overload some policy in use casts, the
// Python side registers one kernel here (`register_kernel`) and writes, per plan, the rule
// the plan gives the overload (`set_rule`): run it as given, cast it to the region's lower
// precision, to float32, to the widest of its inputs, or float32 through its own dtype
// argument. When a region opens or closes, Python writes the thread's innermost context
// (`set_top`). A kernel then casts exactly as the Python handlers of
// `autocast/_handlers.py` do, in native's order, with the same weight-cast cache
// (`Store`: the semantics of `autocast/_cast_cache.py`), and calls the op with every
// autocast key excluded.
//
// Whatever this file does not execute goes to the Python kernel of the same overload,
// which it holds (the reference engine): a thread without a single context of ours in
// force, a native region open inside ours, torch's state switched by hand, rules written
// as Python (fp8, cuDNN RNN, banned ops), a user's rule where torch's checkpoint may be
// running (kGuarded below), and calls with tensors or modes that Python handles (fake,
// functional and subclass tensors, dispatch modes, tracing, functorch, meta, sparse and
// nested tensors).
//
// This file inlines dispatcher and TensorImpl code: a build is valid for the torch it
// was compiled against only (the loader keys its cache on torch's version).
#include <torch/extension.h>

#include <ATen/CachedTensorUtils.h>
#include <ATen/SavedTensorHooks.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/SmallVector.h>
#include <c10/util/flat_hash_map.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/dynamo/compiled_autograd.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/tensor_memoryformats.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <list>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

// -- rules ---------------------------------------------------------------------------------
// The kinds of rule this file executes; anything else stays PYTHON (the Python kernel).
enum Kind : uint8_t { PYTHON = 0, GIVEN = 1, LOWER = 2, FP32 = 3, PROMOTE = 4, FP32_OPT_DTYPE = 5 };
// A rule's word: its kind in the low seven bits, kGuarded, and above them the position of
// the dtype argument (fp32-unless-dtype). kGuarded marks a rule whose kind differs from
// native's table for the region's device (a user's policy): torch's checkpoint recomputes
// under native's table, so such a call is executed here only where torch's checkpoint
// cannot be running (`outside_torch_checkpoint`), and elsewhere goes to the Python
// handler, which refuses with the way out (autocast/_torch_checkpoint.py).
constexpr uint32_t kKindMask = 0x7f;
constexpr uint32_t kGuarded = 0x80;
// Plans are numbered by the Python side; a plan numbered past this runs in Python.
constexpr int kMaxPlans = 64;

struct Config {
  bool last_first = true;            // native casts an op's last argument first (GCC builds)
  PyObject* scope_var = nullptr;     // _cast_cache.SCOPE (a contextvars.ContextVar)
  PyTypeObject* tensor_type = nullptr;
  PyTypeObject* parameter_type = nullptr;
  PyObject* python_lookup = nullptr;  // _cast_cache.lookup, for a store without a twin here
  PyObject* resolve_rule = nullptr;   // _compiled_engine.resolve_rule(kernel, plan): writes one rule
  PyObject* reentrant_code = nullptr;  // the code of torch's reentrant checkpoint's forward
  c10::DispatchKeySet autocast_keys;
  c10::DispatchKeySet below_autocast;
  c10::DispatchKeySet to_python;      // functionality keys whose calls Python handles (and meta tensors)
  bool ready = false;
};
Config g;

// The thread's innermost context, as Python's _engine._refresh derives it.
struct Top {
  bool on = false;
  int64_t depth = -1;  // torch's nesting counter at our innermost region; -1: not checked
  c10::DeviceType device = c10::DeviceType::CPU;
  at::ScalarType dtype = at::kFloat;
  c10::DispatchKey native_key = c10::DispatchKey::AutocastCPU;
  int plan = -1;
};
thread_local Top tls;

std::atomic<uint64_t> g_generation{0};  // optimizer steps seen while a cast_cache is open
// cast_cache scopes open in the process (_cast_cache.STEPS.scopes): while none is, every
// context's store is the per-region one, found without the GIL.
std::atomic<int64_t> g_scopes{0};

// -- batched weight casts: what one bucket's cast leaves ----------------------------------
// A bucket is cast before most of its weights are used (see "batched weight casts" below).
// Its mark records which of its casts a kernel has handed out since: at the region's close
// the edges of the bucket's autograd node to the weights whose casts were never used are
// cut (so nothing reaches a weight the region did not use), and their entries dropped.
struct BatchMark {
  explicit BatchMark(size_t n) : handed(new std::atomic<bool>[n]), size(n) {
    for (size_t i = 0; i < n; ++i) handed[i].store(false, std::memory_order_relaxed);
  }
  std::unique_ptr<std::atomic<bool>[]> handed;
  size_t size;
};

// -- the weight-cast cache ---------------------------------------------------------------
// One store: the process's per-region cache or one cast_cache scope's. An entry holds the
// weight (so its TensorImpl, the key, cannot be reused) and the storage it was cast from
// (so its memory cannot be handed to another tensor behind the check).
struct Entry {
  at::Tensor weight;
  at::ScalarType dtype;
  uint32_t version;
  c10::Storage storage;
  const void* address;
  // Inline up to 6 dimensions: a miss makes one entry per weight per region, and the
  // allocations of a heap vector were a measurable part of it.
  c10::SmallVector<int64_t, 6> sizes, strides;
  uint64_t generation;
  at::Tensor cast;
  uint64_t seq = 0;  // when it was kept: the eviction order of a bounded store
  bool ordered = false;  // whether `order` holds it (only while the store is bounded)
  std::list<c10::TensorImpl*>::iterator order;
  std::shared_ptr<BatchMark> mark;  // set when the cast came from a bucket
  size_t slot = 0;                   // its place in the bucket
};

struct Store;
at::Tensor batch_cast(Store& store, const at::Tensor& t, at::ScalarType dtype, uint64_t generation);
void note_use(const at::Tensor& t);

struct Store : public std::enable_shared_from_this<Store> {
  std::mutex mu;
  // Open addressing, as native's cast cache: a region keeps and drops one entry per
  // weight, and a node-based map allocated and freed one node for each.
  using Entries = ska::flat_hash_map<c10::TensorImpl*, Entry>;
  Entries entries;
  std::list<c10::TensorImpl*> order;  // oldest first, for max_bytes (kept while bounded only)
  uint64_t next_seq = 0;
  int64_t max_bytes = -1;             // -1: unbounded
  int64_t nbytes = 0;                 // counted while bounded
  std::atomic<bool> open{true};

  static bool fresh(const Entry& e, const at::Tensor& t, at::ScalarType dtype, uint64_t generation) {
    if (e.dtype != dtype || e.version != t._version() || t.scalar_type() != at::kFloat) return false;
    if (!t.has_storage() || t.storage().unsafeGetStorageImpl() != e.storage.unsafeGetStorageImpl()) return false;
    if (e.address != t.const_data_ptr() || e.generation != generation) return false;
    return t.sizes().equals(e.sizes) && t.strides().equals(e.strides);
  }

  // The entry's cast if it is fresh, else an undefined tensor (the stale entry is
  // dropped first: its cast's grad_fn holds the weight's accumulator, which records the
  // weight's shape when it is made, see _cast_cache.insert).
  // `batched`: whether a bucket's cast not handed out yet may be used. The Python kernels
  // pass false: what they run (under dispatch modes, tracing) sees a cast made at its use,
  // as native's, never one made ahead of it.
  at::Tensor find(const at::Tensor& t, at::ScalarType dtype, uint64_t generation, bool batched = true) {
    Entry stale;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = entries.find(t.unsafeGetTensorImpl());
      if (it == entries.end()) return at::Tensor();
      Entry& e = it->second;
      if (fresh(e, t, dtype, generation)) {
        if (!e.mark) return e.cast;
        if (batched || e.mark->handed[e.slot].load(std::memory_order_relaxed)) {
          e.mark->handed[e.slot].store(true, std::memory_order_relaxed);
          return e.cast;
        }
      }
      stale = take(it);
    }
    return at::Tensor();  // `stale` goes here, outside the lock (freeing may run Python)
  }

  // Drops the entry of `impl` if it still holds slot `slot` of `mark` (a bucket's cast
  // that was never handed out).
  void drop_unused(c10::TensorImpl* impl, const BatchMark* mark, size_t slot) {
    Entry gone;
    std::lock_guard<std::mutex> lock(mu);
    auto it = entries.find(impl);
    if (it == entries.end() || it->second.mark.get() != mark || it->second.slot != slot) return;
    gone = take(it);
    // `gone` is freed after the lock is released (declared before the guard).
  }

  // For a bucket being cast: whether `t` has a fresh entry (it is left out), dropping a
  // stale one first (into `dropped`, freed by the caller before the bucket is cast: see
  // `find` on why a stale cast must be gone before a new one is made).
  bool has_fresh(const at::Tensor& t, at::ScalarType dtype, uint64_t generation, std::vector<Entry>& dropped) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = entries.find(t.unsafeGetTensorImpl());
    if (it == entries.end()) return false;
    if (fresh(it->second, t, dtype, generation)) return true;
    dropped.push_back(take(it));
    return false;
  }

  Entry take(Entries::iterator it) {
    Entry e = std::move(it->second);
    if (e.ordered) order.erase(e.order);
    if (max_bytes >= 0) nbytes -= static_cast<int64_t>(e.cast.nbytes());
    entries.erase(it);
    return e;
  }

  void keep(const at::Tensor& t, at::ScalarType dtype, uint32_t version, uint64_t generation,
            const void* address, at::Tensor cast, std::shared_ptr<BatchMark> mark = nullptr, size_t slot = 0) {
    std::vector<Entry> dropped;
    std::lock_guard<std::mutex> lock(mu);
    auto key = t.unsafeGetTensorImpl();
    auto it = entries.find(key);
    if (it != entries.end()) dropped.push_back(take(it));
    Entry e;
    e.weight = t;
    e.dtype = dtype;
    e.version = version;
    e.storage = t.storage();
    e.address = address;
    e.sizes.assign(t.sizes().begin(), t.sizes().end());
    e.strides.assign(t.strides().begin(), t.strides().end());
    e.generation = generation;
    e.cast = std::move(cast);
    e.mark = std::move(mark);
    e.slot = slot;
    e.seq = next_seq++;
    if (max_bytes >= 0) {
      order.push_back(key);
      e.order = std::prev(order.end());
      e.ordered = true;
      nbytes += static_cast<int64_t>(e.cast.nbytes());
    }
    entries.emplace(key, std::move(e));
    if (max_bytes >= 0) evict(key, dropped);
    // `dropped` is freed after the lock is released (declared before the guard).
  }

  void evict(c10::TensorImpl* keep_key, std::vector<Entry>& dropped) {
    auto it = order.begin();
    while (nbytes > max_bytes && it != order.end()) {
      auto key = *it++;
      if (key == keep_key) continue;
      auto found = entries.find(key);
      if (found != entries.end()) dropped.push_back(take(found));
    }
  }

  // Frees the casts outside the lock (freeing may run Python), in the map's slot order,
  // and keeps the map's buckets for the next region: as native's cache, a map of the same
  // kind cleared in place at the same point. Each region makes and frees the same casts in
  // the same order as native, so the allocator hands out the same blocks; a cache that
  // freed them in another order (or grew its map anew every region) measurably slowed the
  // next region's casts of large weights.
  void clear() {
    Entries gone;
    {
      std::lock_guard<std::mutex> lock(mu);
      gone.swap(entries);
      order.clear();
      nbytes = 0;
    }
    gone.clear();
    std::lock_guard<std::mutex> lock(mu);
    if (entries.empty() && entries.bucket_count() < gone.bucket_count()) entries.swap(gone);
  }

  void set_max_bytes(int64_t limit) {
    std::vector<Entry> dropped;
    std::lock_guard<std::mutex> lock(mu);
    max_bytes = limit;
    nbytes = 0;
    order.clear();
    for (auto& kv : entries) kv.second.ordered = false;
    if (limit < 0) return;
    // Bounded from now on: the eviction order, oldest kept first.
    std::vector<std::pair<uint64_t, c10::TensorImpl*>> by_age;
    by_age.reserve(entries.size());
    for (auto& kv : entries) {
      by_age.emplace_back(kv.second.seq, kv.first);
      nbytes += static_cast<int64_t>(kv.second.cast.nbytes());
    }
    std::sort(by_age.begin(), by_age.end());
    for (auto& [seq, key] : by_age) {
      Entry& e = entries.find(key)->second;
      order.push_back(key);
      e.order = std::prev(order.end());
      e.ordered = true;
    }
    evict(nullptr, dropped);
  }

  int64_t total_nbytes() {
    std::lock_guard<std::mutex> lock(mu);
    int64_t total = 0;
    for (auto& kv : entries) total += static_cast<int64_t>(kv.second.cast.nbytes());
    return total;
  }

  size_t size() {
    std::lock_guard<std::mutex> lock(mu);
    return entries.size();
  }

  // The cached cast of weight `t` to `dtype`, made now (with grad mode on, as native
  // makes it) if there is none or it is stale; `to`: a Python callable making the cast
  // (the GIL held by the caller), or None for t.to(dtype). `batch`: the compiled kernels'
  // call, which may cast the bucket of `t` (see "batched weight casts").
  at::Tensor cast(const at::Tensor& t, at::ScalarType dtype, PyObject* to = nullptr, bool batch = false) {
    uint64_t generation = g_generation.load(std::memory_order_acquire);
    if (batch) note_use(t);
    at::Tensor hit = find(t, dtype, generation, batch);
    if (hit.defined()) return hit;
    if (batch) {
      at::Tensor batched = batch_cast(*this, t, dtype, generation);
      if (batched.defined()) return batched;
    }
    uint32_t version = t._version();
    bool has_storage = t.has_storage();
    const void* address = has_storage ? t.const_data_ptr() : nullptr;
    at::Tensor out;
    {
      at::AutoGradMode grad_on(true);
      if (to == nullptr || to == Py_None) {
        out = t.to(dtype);
      } else {
        PyObject* arg = THPVariable_Wrap(t);
        if (!arg) throw python_error();
        PyObject* result = PyObject_CallOneArg(to, arg);
        Py_DECREF(arg);
        if (!result) throw python_error();
        out = THPVariable_Unpack(result);
        Py_DECREF(result);
      }
    }
    if (has_storage) keep(t, dtype, version, generation, address, out);
    return out;
  }
};

std::shared_ptr<Store> g_region = std::make_shared<Store>();

// -- kernels -------------------------------------------------------------------------------
// What one call's casts need besides the rule: the store, found at the first weight.
struct CallState {
  std::shared_ptr<Store> store;
  bool store_read = false;
  bool python_store = false;  // the store in force has no twin here: _cast_cache.lookup
  PyObject* python_store_obj = nullptr;
};

inline bool eligible(const at::Tensor& t, c10::DeviceType device) {
  auto d = t.scalar_type();
  return d != at::kDouble && at::isFloatingType(d) && t.device().type() == device;
}

// Whether `t` is a weight native autocast would cache the cast of (cast_one's rule, the
// class test aside: that needs the GIL).
inline bool cacheable(const at::Tensor& t, at::ScalarType dtype) {
  return t.requires_grad() && t.is_leaf() && t.scalar_type() == at::kFloat && dtype == tls.dtype &&
         !t.is_view() && !t.is_inference() && !c10::InferenceMode::is_enabled() &&
         at::autocast::is_autocast_cache_enabled() && !at::caching::is_cached_tensor(t);
}

// -- batched weight casts ------------------------------------------------------------------
// Native casts each weight at its use, one `_to_copy` (and one backward node) per weight in
// every region. Here the weights a thread's region used (in order of first use) become, when
// its outermost region closes, the plan of the next region that starts with the same
// weight: contiguous buckets of it. At a region's first miss of a weight its plan places,
// the whole bucket is cast from the weights' current values in one multi-tensor copy, given
// one autograd node (BatchedWeightCastBackward, which casts each gradient back to float32
// as `_to_copy`'s does), and the casts go into the store as if each had been made at its
// use. Nothing is reused across regions that native would not reuse: the plan holds weak
// references and no values, and each region casts again (inside `cast_cache()` the casts a
// scope keeps are left out of a bucket, as they are hits).
//
// Why buckets: autograd runs ready nodes newest first, so one node for all weights would
// make every weight gradient ready only at the end of the backward (DDP would lose its
// overlap); a bucket's gradients are ready when its first-used weight's is.
//
// A bucket leaves out what native would not cache, or not here: a weight freed, no longer
// float32, on another device, not requiring grad, of another class (subclasses, DTensor),
// a view, or already fresh in the store. A weight changed in place after its bucket's cast
// and before its use fails the store's version test and is cast again at its use (the
// bucket's unused cast is then cut off at the region's close, see BatchMark). Off
// (`batch_active`) under anomaly mode and the JIT tracer, and wherever the call goes to
// the Python kernels (dispatch modes, fake and functional tensors, functorch): what those
// see is native's one cast per weight.
// Off by default (the Python side sets it from DISPATCH_AMP_BATCH_CASTS): on this
// project's CPU it makes steps cheaper and forwards no cheaper, and it moves gradient
// readiness and accumulation's peak (docs/design.md); a GPU measurement decides.
std::atomic<bool> g_batching{false};
// A plan's buckets: 16, so that a weight's gradient is ready at most a sixteenth of the
// region's weights later than native's (DDP's buckets are as coarse on GPT-2 small); at
// least two weights each, a single one being cast as native casts it.
constexpr size_t kBuckets = 16;
constexpr size_t kMinBucket = 2;
constexpr size_t kPlansKept = 8;    // plans kept per thread, the most recently used first

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
using NodePtr = std::decay_t<decltype(std::declval<const at::Tensor&>().grad_fn())>;

// The backward of one bucket's cast: each weight's gradient cast back to float32, as
// `_to_copy`'s backward does, and nothing for a cast unused (no zeros). A plain autograd
// node, made as torch's generated ones are (edges, input metadata, history), and not a
// custom Function: that one's bookkeeping per input and output (their shapes copied twice,
// a set of the inputs, forward-AD checks) cost more than the single casts it replaced.
struct BatchedWeightCastBackward : public torch::autograd::Node {
  std::string name() const override { return "BatchedWeightCastBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    torch::autograd::variable_list out(grads.size());
    if (at::GradMode::is_enabled()) {  // create_graph: differentiable casts
      for (size_t i = 0; i < grads.size(); ++i)
        if (grads[i].defined()) out[i] = grads[i].to(at::kFloat);
      return out;
    }
    std::vector<at::Tensor> src, dst;
    src.reserve(grads.size());
    dst.reserve(grads.size());
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) continue;
      // The layout `_to_copy` gives: the gradient's strides where it is dense.
      out[i] = at::empty_like(grads[i], grads[i].options().dtype(at::kFloat));
      src.push_back(grads[i]);
      dst.push_back(out[i]);
    }
    if (!src.empty()) at::_foreach_copy_(dst, src);
    return out;
  }

  // Compiled autograd: nothing but the inputs decides what this node computes, and its
  // ops trace as any.
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    args.collect(name());
  }
  torch::autograd::variable_list apply_with_saved(const torch::autograd::variable_list& inputs,
                                                  torch::dynamo::autograd::SwapSavedVariables&) override {
    return apply(torch::autograd::variable_list(inputs));
  }
};

// A new node in the pointer torch holds nodes by: a shared_ptr before torch 2.13, an
// intrusive_ptr since.
template <class P>
struct NodeMaker {
  template <class T>
  static P make() { return P(new T()); }
};
template <class N>
struct NodeMaker<c10::intrusive_ptr<N>> {
  template <class T>
  static c10::intrusive_ptr<N> make() { return c10::make_intrusive<T>(); }
};

// The casts of `weights` to `dtype`, one multi-tensor copy, with one node for their
// backward (grad mode on, every weight requiring grad: see `batchable`).
std::vector<at::Tensor> batched_weight_cast(const std::vector<at::Tensor>& weights, at::ScalarType dtype) {
  std::vector<at::Tensor> out;
  out.reserve(weights.size());
  {
    // New tensors that nothing else sees yet: below autograd and the inplace/view layer,
    // as `_to_copy`'s own allocation and copy run.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    for (const at::Tensor& w : weights) out.push_back(at::empty_like(w, w.options().dtype(dtype)));
    at::_foreach_copy_(out, weights);
  }
  NodePtr node = NodeMaker<NodePtr>::template make<BatchedWeightCastBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(weights));
  for (const at::Tensor& cast : out) torch::autograd::set_history(cast, node);
  return out;
}

// A plan: its weights in order of first use, cut into buckets (bucket b is
// weights[starts[b]] up to weights[starts[b + 1]]).
struct Plan {
  struct Place {
    uint32_t bucket, position;
  };
  std::vector<WeakImpl> weights;
  std::vector<uint32_t> starts;  // one more than the buckets: the last is weights.size()
  std::unordered_map<c10::TensorImpl*, Place> place_of;  // keys held alive by the weak refs
  size_t buckets() const { return starts.size() - 1; }
};

struct MadeBucket {
  std::shared_ptr<BatchMark> mark;
  NodePtr node;
  std::vector<WeakImpl> weights;
  std::weak_ptr<Store> store;
};

// This thread's outermost region: what it used, its plan, the buckets it cast.
//
// A region that uses its plan's weights in the plan's order (a training loop's regions
// do) only counts them (`following`, `cursor`: how many it has used); `record` and `seen`
// are filled only once it departs from that order (`depart`).
struct RegionBatch {
  bool started = false;
  bool following = false;
  size_t cursor = 0;
  std::vector<WeakImpl> record;
  std::unordered_set<c10::TensorImpl*> seen;
  std::shared_ptr<Plan> plan;
  std::vector<uint8_t> made;
  std::vector<MadeBucket> made_buckets;
};
thread_local RegionBatch tl_region;
// Plans, keyed by their first weight (held alive by the plan's weak reference).
thread_local std::list<std::pair<c10::TensorImpl*, std::shared_ptr<Plan>>> tl_plans;

inline bool batch_active() {
  return g_batching.load(std::memory_order_relaxed) && !torch::autograd::AnomalyMode::is_enabled() &&
         !torch::jit::tracer::isTracing();
}

// The region stops following its plan's order: what it used so far is the plan's first
// `cursor` weights.
void depart(RegionBatch& rb) {
  rb.following = false;
  rb.record.assign(rb.plan->weights.begin(), rb.plan->weights.begin() + rb.cursor);
  for (const WeakImpl& w : rb.record) rb.seen.insert(w._unsafe_get_target());
}

void note_use(const at::Tensor& t) {
  RegionBatch& rb = tl_region;
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (!rb.started) {  // the region's first weight picks its plan
    rb.started = true;
    for (auto it = tl_plans.begin(); it != tl_plans.end(); ++it) {
      if (it->first != impl) continue;
      rb.plan = it->second;
      rb.made.assign(rb.plan->buckets(), 0);
      tl_plans.splice(tl_plans.begin(), tl_plans, it);
      rb.following = true;
      rb.cursor = 1;
      return;
    }
  } else if (rb.following) {
    const std::vector<WeakImpl>& order = rb.plan->weights;
    if (rb.cursor < order.size() && order[rb.cursor]._unsafe_get_target() == impl) {
      ++rb.cursor;
      return;
    }
    auto place = rb.plan->place_of.find(impl);
    if (place != rb.plan->place_of.end() && place->second.position < rb.cursor) return;  // used again
    depart(rb);
  }
  if (rb.seen.insert(impl).second) rb.record.emplace_back(t.getIntrusivePtr());
}

// Whether `w` may join a bucket: what `cacheable` and the class test in
// `plain_class_and_store` ask of a weight at its use, read without the GIL.
bool batchable(const at::Tensor& w, at::ScalarType dtype) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
  if (!cacheable(w, dtype) || w.device().type() != tls.device || !w.has_storage()) return false;
  if (!(w.key_set() & g.to_python).empty() || w.is_meta()) return false;
  if (w._fw_grad(/*level=*/0).defined()) return false;  // a tangent: the node carries none
  PyObject* own = w.unsafeGetTensorImpl()->pyobj_slot()->load_pyobj();
  if (own != nullptr) {
    PyTypeObject* type = Py_TYPE(own);
    if (type != g.tensor_type && type != g.parameter_type) return false;
  }
  return true;
#else
  return false;  // the class test needs the GIL before torch 2.13: no batching there
#endif
}

at::Tensor batch_cast(Store& store, const at::Tensor& t, at::ScalarType dtype, uint64_t generation) {
  RegionBatch& rb = tl_region;
  if (!rb.plan) return at::Tensor();
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  auto found = rb.plan->place_of.find(impl);
  if (found == rb.plan->place_of.end()) return at::Tensor();
  uint32_t b = found->second.bucket;
  if (rb.made[b]) return at::Tensor();  // cast already: `t` changed since, or was left out
  rb.made[b] = 1;
  std::vector<at::Tensor> weights;
  size_t mine = SIZE_MAX;
  {
    std::vector<Entry> dropped;  // stale entries, freed before the bucket is cast
    for (uint32_t i = rb.plan->starts[b]; i < rb.plan->starts[b + 1]; ++i) {
      auto strong = rb.plan->weights[i].lock();
      if (!strong) continue;
      if (strong.get() == impl) {
        mine = weights.size();
        weights.push_back(t);
        continue;
      }
      at::Tensor w(std::move(strong));
      if (!batchable(w, dtype) || store.has_fresh(w, dtype, generation, dropped)) continue;
      weights.push_back(std::move(w));
    }
  }
  if (mine == SIZE_MAX || weights.size() < 2) return at::Tensor();
  std::vector<uint32_t> versions;
  std::vector<const void*> addresses;
  versions.reserve(weights.size());
  addresses.reserve(weights.size());
  for (const at::Tensor& w : weights) {
    versions.push_back(w._version());
    addresses.push_back(w.const_data_ptr());
  }
  std::vector<at::Tensor> casts;
  {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(g.autocast_keys);
    casts = batched_weight_cast(weights, dtype);
  }
  auto mark = std::make_shared<BatchMark>(weights.size());
  mark->handed[mine].store(true, std::memory_order_relaxed);
  MadeBucket made{mark, casts[0].grad_fn(), {}, store.weak_from_this()};
  made.weights.reserve(weights.size());
  for (size_t i = 0; i < weights.size(); ++i) {
    store.keep(weights[i], dtype, versions[i], generation, addresses[i], casts[i], mark, i);
    made.weights.emplace_back(weights[i].getIntrusivePtr());
  }
  rb.made_buckets.push_back(std::move(made));
  return casts[mine];
}

// Whether `record` is `plan`'s weights in its order (the common case: a training loop's
// regions use the same weights in the same order), so that the plan need not be rebuilt.
bool same_order(const Plan& plan, const std::vector<WeakImpl>& record) {
  if (plan.weights.size() != record.size()) return false;
  for (size_t i = 0; i < record.size(); ++i)
    if (record[i]._unsafe_get_target() != plan.weights[i]._unsafe_get_target()) return false;
  return true;
}

// This thread's outermost region closed: the casts of its buckets never handed out are cut
// off (their node's edge to the weight, and their entry), and what it used is the plan of
// the next region that starts as it did.
void region_closed() {
  RegionBatch done;
  std::swap(done, tl_region);
  for (MadeBucket& m : done.made_buckets) {
    for (size_t i = 0; i < m.mark->size; ++i) {
      if (m.mark->handed[i].load(std::memory_order_relaxed)) continue;
      // Written in place: set_next_edge refuses a node with a parent (it would raise the
      // node's topological number); dropping an edge never needs that raised.
      if (m.node) m.node->next_edges()[i] = torch::autograd::Edge();
      auto store = m.store.lock();
      auto weight = m.weights[i].lock();
      if (store && weight) store->drop_unused(weight.get(), m.mark.get(), i);
    }
  }
  if (done.following) {
    if (done.cursor == done.plan->weights.size()) return;  // the plan it used stays
    depart(done);  // it used a part of its plan: that part is the next plan
  }
  if (done.record.empty()) return;
  if (done.plan && same_order(*done.plan, done.record)) return;  // the plan it used stays
  auto plan = std::make_shared<Plan>();
  size_t n = done.record.size();
  size_t per = std::max(kMinBucket, (n + kBuckets - 1) / kBuckets);
  plan->weights = std::move(done.record);
  plan->place_of.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (i % per == 0) plan->starts.push_back(static_cast<uint32_t>(i));
    plan->place_of[plan->weights[i]._unsafe_get_target()] = {static_cast<uint32_t>(plan->starts.size() - 1),
                                                              static_cast<uint32_t>(i)};
  }
  plan->starts.push_back(static_cast<uint32_t>(n));
  c10::TensorImpl* key = plan->weights[0]._unsafe_get_target();
  tl_plans.remove_if([&](const auto& p) { return p.first == key; });
  tl_plans.emplace_front(key, std::move(plan));
  if (tl_plans.size() > kPlansKept) tl_plans.pop_back();
}

// The cast_cache scope this thread found last and its twin, so that the next call in the
// same scope finds its store without the attribute lookup and the pybind11 conversion
// (inside cast_cache() every call that casts a weight reads the scope). The reference
// keeps the object's address from being reused by another scope; it is never released at
// thread exit (that needs the GIL): what a thread leaves is one closed, emptied store. The
// raw pointer is kept alive by the object, which holds its twin.
struct ScopeSeen {
  PyObject* object = nullptr;
  Store* store = nullptr;
};
thread_local ScopeSeen tl_scope;

// Whether `t`'s Python class is torch.Tensor or Parameter (a subclass is never cached, as
// in cast_one), and the store of this context (read once per call). The class is read
// from the tensor's Python object without the GIL where torch exposes it (a tensor without
// one is a plain Tensor to Python); the store needs the GIL only while a cast_cache scope
// is open somewhere.
bool plain_class_and_store(const at::Tensor& t, CallState& cs) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
  PyObject* own = t.unsafeGetTensorImpl()->pyobj_slot()->load_pyobj();
  if (own != nullptr) {
    PyTypeObject* type = Py_TYPE(own);
    if (type != g.tensor_type && type != g.parameter_type) return false;
  }
  if (!cs.store_read && g_scopes.load(std::memory_order_acquire) == 0) {
    cs.store_read = true;
    cs.store = g_region;
  }
  if (cs.store_read) return true;
  pybind11::gil_scoped_acquire gil;
#else
  pybind11::gil_scoped_acquire gil;
  PyObject* obj = THPVariable_Wrap(t);
  if (!obj) throw python_error();
  PyTypeObject* type = Py_TYPE(obj);
  Py_DECREF(obj);
  if (type != g.tensor_type && type != g.parameter_type) return false;
#endif
  if (!cs.store_read) {
    cs.store_read = true;
    PyObject* value = nullptr;
    if (PyContextVar_Get(g.scope_var, nullptr, &value) < 0) throw python_error();
    if (value == nullptr || value == Py_None) {
      cs.store = g_region;
    } else if (value == tl_scope.object) {
      // The scope this thread found last (a twin, once attached, never changes).
      cs.store = tl_scope.store->open.load() ? tl_scope.store->shared_from_this() : g_region;
    } else {
      static PyObject* native_name = PyUnicode_InternFromString("native");
      PyObject* native = PyObject_GetAttr(value, native_name);
      if (!native) {
        Py_DECREF(value);
        throw python_error();
      }
      if (native == Py_None) {
        cs.python_store = true;
      } else {
        auto store = pybind11::cast<std::shared_ptr<Store>>(pybind11::handle(native));
        // A scope closed from another context (a generator finished elsewhere): the
        // per-region cache, as _cast_cache._store says.
        cs.store = store->open.load() ? store : g_region;
        Py_INCREF(value);
        Py_XDECREF(tl_scope.object);
        tl_scope.object = value;
        tl_scope.store = store.get();
      }
      Py_DECREF(native);
    }
    Py_XDECREF(value);
  }
  return true;
}

at::Tensor python_lookup(const at::Tensor& t, at::ScalarType dtype) {
  pybind11::gil_scoped_acquire gil;
  PyObject* arg = THPVariable_Wrap(t);
  if (!arg) throw python_error();
  PyObject* py_dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(dtype));
  PyObject* result = PyObject_CallFunctionObjArgs(g.python_lookup, arg, py_dtype, Py_None, nullptr);
  Py_DECREF(arg);
  if (!result) throw python_error();
  at::Tensor out = THPVariable_Unpack(result);
  Py_DECREF(result);
  return out;
}

// `t` cast to `dtype` if native autocast would cast it, else `t` itself (cast_one).
at::Tensor cast_one(const at::Tensor& t, at::ScalarType dtype, CallState& cs) {
  auto d = t.scalar_type();
  if (d == dtype || d == at::kDouble || !at::isFloatingType(d) || t.device().type() != tls.device) return t;
  if (cacheable(t, dtype) && plain_class_and_store(t, cs)) {
    if (cs.python_store) return python_lookup(t, dtype);
    return cs.store->cast(t, dtype, nullptr, batch_active());
  }
  return t.to(dtype);
}

// Casts the tensors of one argument (one level inside lists, first to last); returns
// whether it changed.
bool cast_argument(c10::IValue& arg, at::ScalarType dtype, CallState& cs) {
  if (arg.isTensor()) {
    const at::Tensor& t = arg.toTensor();
    at::Tensor b = cast_one(t, dtype, cs);
    if (b.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return false;
    arg = c10::IValue(std::move(b));
    return true;
  }
  if (arg.isTensorList()) {
    auto list = arg.toTensorList();
    c10::List<at::Tensor> out;
    out.reserve(list.size());
    bool changed = false;
    for (size_t i = 0; i < list.size(); ++i) {
      at::Tensor t = list.get(i);
      at::Tensor b = cast_one(t, dtype, cs);
      changed |= b.unsafeGetTensorImpl() != t.unsafeGetTensorImpl();
      out.push_back(std::move(b));
    }
    if (changed) arg = c10::IValue(std::move(out));
    return changed;
  }
  if (arg.isList()) {  // Tensor?[] (indices): tensors and None
    auto list = arg.toList();
    if (list.size() == 0) return false;
    c10::impl::GenericList out(list.elementType());
    out.reserve(list.size());
    bool changed = false;
    for (size_t i = 0; i < list.size(); ++i) {
      c10::IValue v = list.get(i);
      if (v.isTensor()) {
        const at::Tensor& t = v.toTensor();
        at::Tensor b = cast_one(t, dtype, cs);
        if (b.unsafeGetTensorImpl() != t.unsafeGetTensorImpl()) {
          changed = true;
          v = c10::IValue(std::move(b));
        }
      } else if (!v.isNone()) {
        return false;  // a list of ints, floats, bools: no tensors in it
      }
      out.push_back(std::move(v));
    }
    if (changed) arg = c10::IValue(std::move(out));
    return changed;
  }
  return false;
}

void cast_all(torch::jit::Stack* stack, size_t base, size_t n, at::ScalarType dtype, CallState& cs) {
  if (g.last_first) {
    for (size_t i = n; i-- > 0;) cast_argument((*stack)[base + i], dtype, cs);
  } else {
    for (size_t i = 0; i < n; ++i) cast_argument((*stack)[base + i], dtype, cs);
  }
}

// Native's promote rule: float32 if any eligible input is float32, else the region's
// dtype; another floating dtype among them: nullopt (Python raises native's error).
// Whether promote handles `t` beside the inputs seen so far, widening `widest` to float32
// where `t` asks for it.
inline bool see_slot(const at::Tensor& t, at::ScalarType& widest) {
  auto d = t.scalar_type();
  if (d == widest || d == at::kDouble || !at::isFloatingType(d) || t.device().type() != tls.device) return true;
  if (d == at::kFloat || widest == at::kFloat) {
    widest = at::kFloat;
    return true;
  }
  return false;
}

std::optional<at::ScalarType> promote_dtype(torch::jit::Stack* stack, size_t base, size_t n) {
  at::ScalarType widest = tls.dtype;
  auto see = [&](const at::Tensor& t) -> bool { return see_slot(t, widest); };
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& a = (*stack)[base + i];
    if (a.isTensor()) {
      if (!see(a.toTensor())) return std::nullopt;
    } else if (a.isTensorList()) {
      for (const at::Tensor& t : a.toTensorList().vec())
        if (!see(t)) return std::nullopt;
    } else if (a.isList()) {
      for (const c10::IValue& v : a.toListRef())
        if (v.isTensor() && !see(v.toTensor())) return std::nullopt;
    }
  }
  return widest;
}

PyObject* ivalue_to_python(const c10::Argument& arg, const c10::IValue& v) {
  if (v.isNone()) Py_RETURN_NONE;
  auto match = [&](c10::TypeKind kind) {
    const auto& t = arg.real_type();
    if (t->kind() == kind) return true;
    if (auto opt = t->cast<c10::OptionalType>()) return opt->getElementType()->kind() == kind;
    return false;
  };
  if (match(c10::ScalarTypeType::Kind)) {
    PyObject* obj = reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<c10::ScalarType>(v.toInt())));
    Py_INCREF(obj);
    return obj;
  }
  if (match(c10::LayoutType::Kind)) {
    PyObject* obj = reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<c10::Layout>(v.toInt())));
    Py_INCREF(obj);
    return obj;
  }
  if (match(c10::MemoryFormatType::Kind)) {
    PyObject* obj = torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(v.toInt()));
    Py_INCREF(obj);
    return obj;
  }
  return torch::jit::toPyObject(v).release().ptr();
}

// Whether torch's checkpoint cannot be running the calling code, read for a kGuarded rule:
// the Python handler's test (`inside_torch_checkpoint`) without the cost of a call into
// Python. The non-reentrant variant packs saved tensors with its own hooks, so any
// saved-tensor hooks send the call to Python, which tells whose they are. The reentrant
// variant runs the function inside its autograd Function's forward: the Python stack is
// searched for that forward, as the Python test does (under the GIL; the walk
// materializes the frame objects it passes, 3 to 7 us a call on a model's forward here,
// against about 47 us for a call of the Python handler).
bool outside_torch_checkpoint() {
  if (!at::SavedTensorDefaultHooks::get_tls_state().stack.empty()) return false;
  pybind11::gil_scoped_acquire gil;
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);
    bool inside = reinterpret_cast<PyObject*>(code) == g.reentrant_code;
    Py_DECREF(code);
    PyFrameObject* back = inside ? nullptr : PyFrame_GetBack(frame);
    Py_DECREF(frame);
    if (inside) return false;
    frame = back;
  }
  return true;
}

// A rule not written yet: the first call under that plan asks Python for it.
constexpr uint32_t kUnknown = 0xffffffffu;

struct Kernel : public c10::OperatorKernel {
  Kernel(PyObject* python_kernel, int64_t number) : python(python_kernel), index(number) {
    Py_INCREF(python);  // kept for the life of the process, as the registration is
    for (auto& r : rules) r.store(kUnknown, std::memory_order_relaxed);
  }

  PyObject* python;
  int64_t index;
  // Per plan: the rule's word (kind, kGuarded, the dtype argument's position).
  std::array<std::atomic<uint32_t>, kMaxPlans> rules;

  // The rule of this overload under `plan`, asking Python (which writes it) the first time:
  // a plan's rules are written as its calls first need them, not all at its first region.
  uint32_t rule_for(int plan) {
    uint32_t rule = rules[plan].load(std::memory_order_relaxed);
    if (rule != kUnknown) return rule;
    pybind11::gil_scoped_acquire gil;
    PyObject* out = PyObject_CallFunction(g.resolve_rule, "LL", static_cast<long long>(index),
                                          static_cast<long long>(plan));
    if (!out) {
      python_error error;
      error.persist();
      throw error;
    }
    Py_DECREF(out);
    rule = rules[plan].load(std::memory_order_relaxed);
    return rule == kUnknown ? static_cast<uint32_t>(PYTHON) : rule;
  }

  // The call as the Python kernel makes it: its arguments as the dispatcher hands them to
  // Python (trailing defaults left out, keyword-only ones as keywords), the keyset first.
  void to_python(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    const auto& schema = op.schema();
    const auto& arguments = schema.arguments();
    size_t n = arguments.size();
    auto values = torch::jit::pop(*stack, n);
    pybind11::gil_scoped_acquire gil;
    size_t kwarg_start = n;
    while (kwarg_start > 0 && arguments[kwarg_start - 1].kwarg_only()) --kwarg_start;
    auto is_default = [&](size_t i) {
      const auto& d = arguments[i].default_value();
      return d.has_value() && *d == values[i];
    };
    size_t positional = kwarg_start;
    while (positional > 0 && is_default(positional - 1)) --positional;
    pybind11::tuple args(positional + 1);
    args[0] = pybind11::cast(ks);
    for (size_t i = 0; i < positional; ++i)
      args[i + 1] = pybind11::reinterpret_steal<pybind11::object>(ivalue_to_python(arguments[i], values[i]));
    pybind11::dict kwargs;
    for (size_t i = kwarg_start; i < n; ++i) {
      if (is_default(i)) continue;
      kwargs[pybind11::str(arguments[i].name())] =
          pybind11::reinterpret_steal<pybind11::object>(ivalue_to_python(arguments[i], values[i]));
    }
    PyObject* out = PyObject_Call(python, args.ptr(), kwargs.ptr());
    if (!out) {
      python_error error;
      error.persist();
      throw error;
    }
    auto result = pybind11::reinterpret_steal<pybind11::object>(out);
    const auto& returns = schema.returns();
    if (returns.size() == 1) {
      torch::jit::push(*stack, torch::jit::toIValue(result, returns[0].real_type()));
    } else if (returns.size() > 1) {
      auto seq = pybind11::cast<pybind11::sequence>(result);
      for (size_t i = 0; i < returns.size(); ++i)
        torch::jit::push(*stack, torch::jit::toIValue(seq[i], returns[i].real_type()));
    }
  }

  void run_without_autocast(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
    c10::impl::ExcludeDispatchKeyGuard guard(g.autocast_keys);
    op.callBoxed(stack);
  }

  // Whether this file executes the call (else the Python kernel does): see the top of
  // the file. The unboxed kernels below ask the same question first.
  static bool executes(c10::DispatchKeySet ks, const Top& top) {
    if (!top.on || top.plan < 0 || top.plan >= kMaxPlans || !(ks & g.to_python).empty() ||
        ks.has_backend(c10::BackendComponent::MetaBit))
      return false;
    // A native region opened inside our innermost raised torch's nesting counter.
    if (top.depth >= 0) {
      at::autocast::increment_nesting();
      if (at::autocast::decrement_nesting() > top.depth) return false;
    }
    // torch's state switched by hand inside the region: Python follows it.
    return !c10::impl::tls_is_dispatch_key_excluded(top.native_key) &&
           at::autocast::get_autocast_dtype(top.device) == top.dtype;
  }

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    const Top& top = tls;
    if (!executes(ks, top)) return to_python(op, ks, stack);
    uint32_t rule = rule_for(top.plan);
    if ((rule & kGuarded) && !outside_torch_checkpoint()) return to_python(op, ks, stack);
    size_t n = op.schema().arguments().size();
    size_t base = stack->size() - n;
    CallState cs;
    switch (static_cast<Kind>(rule & kKindMask)) {
      case GIVEN:
        op.redispatchBoxed(ks & g.below_autocast, stack);
        return;
      case LOWER:
        cast_all(stack, base, n, top.dtype, cs);
        return run_without_autocast(op, stack);
      case FP32:
        cast_all(stack, base, n, at::kFloat, cs);
        return run_without_autocast(op, stack);
      case PROMOTE: {
        auto widest = promote_dtype(stack, base, n);
        if (!widest) return to_python(op, ks, stack);
        cast_all(stack, base, n, *widest, cs);
        return run_without_autocast(op, stack);
      }
      case FP32_OPT_DTYPE: {
        size_t position = rule >> 8;
        c10::IValue& given = (*stack)[base + position];
        const c10::IValue& first = (*stack)[base];
        if (given.isNone() && first.isTensor() && eligible(first.toTensor(), top.device))
          given = c10::IValue(static_cast<int64_t>(at::kFloat));
        return run_without_autocast(op, stack);
      }
      default:
        return to_python(op, ks, stack);
    }
  }
};

// -- unboxed kernels for the overloads models call most -------------------------------------
// The dispatcher calls a boxed kernel with its arguments packed into IValues, and the op
// called again from it unpacks them (and packs its result) once more: on a linear layer
// that is a few hundred nanoseconds native's unboxed kernels do not spend. For the
// overloads in `fast_overloads` (matmuls, convolutions, attention, norms, softmax, the
// losses models end with) the kernel registered at our key is unboxed, typed by the
// overload's signature in the torch this file is compiled against (`at::_ops::<op>`). It
// asks `Kernel::executes` and reads the same rule as the boxed kernel, casts the same
// tensors in the same order through the same `cast_one`, and calls the op with every
// autocast key excluded; any call it does not execute (a Python rule, a dispatch mode, a
// promote between two low-precision dtypes) it packs and hands to the boxed kernel of the
// same overload. One behaviour, two entry points: tests/compiled/test_engine.py checks
// that every overload here takes the unboxed kernel and gives the boxed kernel's results.

// What a call's argument becomes while its tensors are cast: a tensor (or an optional
// one) is held by value so that its cast can replace it; anything else is kept as given.
template <class A> struct Slot { using type = A; };
template <> struct Slot<const at::Tensor&> { using type = at::Tensor; };
template <> struct Slot<const std::optional<at::Tensor>&> { using type = std::optional<at::Tensor>; };

inline void cast_slot(at::Tensor& t, at::ScalarType dtype, CallState& cs) { t = cast_one(t, dtype, cs); }
inline void cast_slot(std::optional<at::Tensor>& t, at::ScalarType dtype, CallState& cs) {
  if (t.has_value()) *t = cast_one(*t, dtype, cs);
}
template <class T> inline void cast_slot(T&, at::ScalarType, CallState&) {}

// promote_dtype's `see` over an optional argument (see_slot above for a tensor).
inline bool see_slot(const std::optional<at::Tensor>& t, at::ScalarType& widest) {
  return !t.has_value() || see_slot(*t, widest);
}
template <class T> inline bool see_slot(const T&, at::ScalarType&) { return true; }

// The fp32-unless-dtype rule's argument: float32 when none is given and the first
// argument is an eligible tensor; false: the rule's position is not such an argument.
inline bool set_opt_dtype(std::optional<at::ScalarType>& d, bool first_eligible) {
  if (!d.has_value() && first_eligible) d = at::kFloat;
  return true;
}
template <class T> inline bool set_opt_dtype(T&, bool) { return false; }

template <class T> inline bool first_eligible(const T&) { return false; }
inline bool first_eligible(const at::Tensor& t) { return eligible(t, tls.device); }

template <class T> struct IsTensorList : std::false_type {};
template <> struct IsTensorList<at::TensorList> : std::true_type {};
template <> struct IsTensorList<const at::ITensorListRef&> : std::true_type {};
template <> struct IsTensorList<const c10::List<std::optional<at::Tensor>>&> : std::true_type {};

// This thread's calls of the unboxed kernels: executed here, and handed to the boxed
// kernel (what tests/compiled/test_unboxed.py reads; a thread-local add costs nothing).
struct UnboxedCounts {
  uint64_t executed = 0;
  uint64_t handed = 0;
};
thread_local UnboxedCounts tl_unboxed;

template <class Op, class Sig = typename Op::schema> struct Fast;
template <class Op, class R, class... Args> struct Fast<Op, R(Args...)> {
  static_assert(!(IsTensorList<Args>::value || ...),
                "an overload with a list of tensors stays boxed (cast_argument handles lists)");
  using Slots = std::tuple<typename Slot<Args>::type...>;
  static constexpr size_t N = sizeof...(Args);

  template <size_t... I>
  static void cast_slots(Slots& s, at::ScalarType dtype, CallState& cs, std::index_sequence<I...>) {
    // Native's order (see Config::last_first); a fold over `,` runs left to right.
    if (g.last_first) {
      (cast_slot(std::get<N - 1 - I>(s), dtype, cs), ...);
    } else {
      (cast_slot(std::get<I>(s), dtype, cs), ...);
    }
  }

  template <size_t... I>
  static bool promote_slots(const Slots& s, at::ScalarType& widest, std::index_sequence<I...>) {
    return (see_slot(std::get<I>(s), widest) && ...);
  }

  template <size_t... I>
  static bool opt_dtype_slots(Slots& s, size_t position, std::index_sequence<I...>) {
    bool first = first_eligible(std::get<0>(s));
    bool found = false;
    ((found = found || (I == position && set_opt_dtype(std::get<I>(s), first))), ...);
    return found;
  }

  static R call_without_autocast(Slots& s) {
    c10::impl::ExcludeDispatchKeyGuard guard(g.autocast_keys);
    return std::apply([](auto&... a) { return Op::call(a...); }, s);
  }

  static R boxed(Kernel* kernel, const c10::OperatorHandle& op, c10::DispatchKeySet ks, Args... args) {
    ++tl_unboxed.handed;
    torch::jit::Stack stack = c10::impl::boxArgs<Args...>(std::forward<Args>(args)...);
    (*kernel)(op, ks, &stack);
    return c10::impl::PopResult<R>::call(stack);
  }

  // Straight to the Python kernel (a kGuarded rule that torch's checkpoint may be running).
  static R python(Kernel* kernel, const c10::OperatorHandle& op, c10::DispatchKeySet ks, Args... args) {
    ++tl_unboxed.handed;
    torch::jit::Stack stack = c10::impl::boxArgs<Args...>(std::forward<Args>(args)...);
    kernel->to_python(op, ks, &stack);
    return c10::impl::PopResult<R>::call(stack);
  }

  static R run(Kernel* kernel, const c10::OperatorHandle& op, c10::DispatchKeySet ks, Args... args) {
    const Top& top = tls;
    if (!Kernel::executes(ks, top)) return boxed(kernel, op, ks, std::forward<Args>(args)...);
    uint32_t rule = kernel->rule_for(top.plan);
    if ((rule & kGuarded) && !outside_torch_checkpoint()) return python(kernel, op, ks, std::forward<Args>(args)...);
    auto seq = std::index_sequence_for<Args...>{};
    switch (static_cast<Kind>(rule & kKindMask)) {
      case GIVEN:
        ++tl_unboxed.executed;
        return Op::redispatch(ks & g.below_autocast, std::forward<Args>(args)...);
      case LOWER:
      case FP32: {
        ++tl_unboxed.executed;
        Slots s(args...);  // copies: a call handed to the boxed kernel still has its arguments
        CallState cs;
        cast_slots(s, (rule & kKindMask) == LOWER ? top.dtype : at::kFloat, cs, seq);
        return call_without_autocast(s);
      }
      case PROMOTE: {
        Slots s(args...);
        at::ScalarType widest = top.dtype;
        if (!promote_slots(s, widest, seq)) break;
        ++tl_unboxed.executed;
        CallState cs;
        cast_slots(s, widest, cs, seq);
        return call_without_autocast(s);
      }
      case FP32_OPT_DTYPE: {
        Slots s(args...);
        if (!opt_dtype_slots(s, rule >> 8, seq)) break;
        ++tl_unboxed.executed;
        return call_without_autocast(s);
      }
      default:
        break;
    }
    return boxed(kernel, op, ks, std::forward<Args>(args)...);
  }

  static torch::CppFunction make(Kernel* kernel, c10::OperatorHandle op) {
    return torch::CppFunction([kernel, op](c10::DispatchKeySet ks, Args... args) -> R {
      return run(kernel, op, ks, std::forward<Args>(args)...);
    });
  }
};

using FastMaker = torch::CppFunction (*)(Kernel*, c10::OperatorHandle);

template <class Op> std::pair<std::string, FastMaker> fast_entry() {
  std::string key = Op::name;
  if (Op::overload_name[0] != '\0') key += std::string(".") + Op::overload_name;
  return {key, [](Kernel* kernel, c10::OperatorHandle op) { return Fast<Op>::make(kernel, op); }};
}

// The overloads with an unboxed kernel: those native's CPU and CUDA tables cast that real
// models call per layer. Any other overload a policy casts keeps the boxed kernel, which
// behaves the same, a little slower per call.
const std::unordered_map<std::string, FastMaker>& fast_overloads() {
  namespace ops = at::_ops;
  static const std::unordered_map<std::string, FastMaker> table = {
      fast_entry<ops::linear>(), fast_entry<ops::addmm>(), fast_entry<ops::mm>(), fast_entry<ops::bmm>(),
      fast_entry<ops::baddbmm>(), fast_entry<ops::matmul>(), fast_entry<ops::addmv>(), fast_entry<ops::mv>(),
      fast_entry<ops::conv1d>(), fast_entry<ops::conv2d>(), fast_entry<ops::conv3d>(),
      fast_entry<ops::conv_transpose1d>(), fast_entry<ops::conv_transpose2d_input>(),
      fast_entry<ops::conv_transpose3d_input>(), fast_entry<ops::convolution>(), fast_entry<ops::_convolution>(),
      fast_entry<ops::prelu>(), fast_entry<ops::scaled_dot_product_attention>(),
      fast_entry<ops::layer_norm>(), fast_entry<ops::native_layer_norm>(), fast_entry<ops::group_norm>(),
      fast_entry<ops::softmax_int>(), fast_entry<ops::log_softmax_int>(), fast_entry<ops::nll_loss>(),
      fast_entry<ops::nll_loss_nd>(), fast_entry<ops::cross_entropy_loss>(), fast_entry<ops::mse_loss>(),
      fast_entry<ops::binary_cross_entropy_with_logits>(), fast_entry<ops::exp>(), fast_entry<ops::log>(),
      fast_entry<ops::rsqrt>(), fast_entry<ops::pow_Tensor_Scalar>(), fast_entry<ops::sum>(),
      fast_entry<ops::sum_dim_IntList>(), fast_entry<ops::cumsum>(), fast_entry<ops::addcmul>(),
      fast_entry<ops::addcdiv>(),
  };
  return table;
}

std::vector<std::unique_ptr<torch::Library>> g_libraries;
std::unordered_map<std::string, torch::Library*> g_library_by_namespace;
std::vector<Kernel*> g_kernels;  // owned by the dispatcher's registrations, or g_fallbacks
std::vector<std::unique_ptr<Kernel>> g_fallbacks;  // the boxed kernels behind unboxed ones
std::unordered_set<std::string> g_fast;  // the overloads registered with an unboxed kernel

// -- what Python calls ---------------------------------------------------------------------
void init(bool last_first, pybind11::object scope_var, pybind11::object tensor_type,
          pybind11::object parameter_type, pybind11::object python_lookup, pybind11::object resolve_rule,
          pybind11::object reentrant_code) {
  g.last_first = last_first;
  g.scope_var = scope_var.release().ptr();
  g.tensor_type = reinterpret_cast<PyTypeObject*>(tensor_type.release().ptr());
  g.parameter_type = reinterpret_cast<PyTypeObject*>(parameter_type.release().ptr());
  g.python_lookup = python_lookup.release().ptr();
  g.resolve_rule = resolve_rule.release().ptr();
  g.reentrant_code = reentrant_code.release().ptr();
  g.autocast_keys = c10::autocast_dispatch_keyset | c10::DispatchKeySet(c10::DispatchKey::AutocastPrivateUse1);
  g.below_autocast = c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::AutocastCPU)
                         .remove(c10::DispatchKey::PythonDispatcher);
  g.to_python = c10::DispatchKeySet({
      c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot, c10::DispatchKey::PythonDispatcher,
      c10::DispatchKey::PreDispatch, c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchBatched,
      c10::DispatchKey::FuncTorchVmapMode, c10::DispatchKey::FuncTorchGradWrapper,
      c10::DispatchKey::FuncTorchDynamicLayerBackMode, c10::DispatchKey::FuncTorchDynamicLayerFrontMode,
      c10::DispatchKey::Batched, c10::DispatchKey::VmapMode, c10::DispatchKey::BatchedNestedTensor,
      c10::DispatchKey::Sparse, c10::DispatchKey::SparseCsr, c10::DispatchKey::NestedTensor,
      c10::DispatchKey::Quantized,
  });
  g.ready = true;
}

int64_t register_kernel(const std::string& ns, const std::string& name, pybind11::object python_kernel) {
  TORCH_CHECK(g.ready, "dispatch_amp's compiled engine: init() must run before register_kernel()");
  auto found = g_library_by_namespace.find(ns);
  torch::Library* library;
  if (found == g_library_by_namespace.end()) {
    g_libraries.push_back(
        std::make_unique<torch::Library>(torch::Library::IMPL, ns, std::nullopt, __FILE__, __LINE__));
    library = g_libraries.back().get();
    g_library_by_namespace.emplace(ns, library);
  } else {
    library = found->second;
  }
  auto kernel = std::make_unique<Kernel>(python_kernel.ptr(), static_cast<int64_t>(g_kernels.size()));
  Kernel* raw = kernel.get();
  auto fast = fast_overloads().find(ns + "::" + name);
  if (fast == fast_overloads().end()) {
    library->impl(name.c_str(), torch::dispatch(c10::DispatchKey::AutocastPrivateUse1,
                                                torch::CppFunction::makeFromBoxedFunctor(std::move(kernel))));
  } else {
    // The boxed kernel stays, unregistered, as the unboxed one's fallback (owned here).
    auto dot = name.find('.');
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(
        (ns + "::" + name.substr(0, dot)).c_str(), dot == std::string::npos ? "" : name.substr(dot + 1).c_str());
    g_fallbacks.push_back(std::move(kernel));
    library->impl(name.c_str(), torch::dispatch(c10::DispatchKey::AutocastPrivateUse1, fast->second(raw, op)));
    g_fast.insert(ns + "::" + name);
  }
  g_kernels.push_back(raw);
  return static_cast<int64_t>(g_kernels.size() - 1);
}

void set_rule(int64_t kernel, int64_t plan, int64_t kind, int64_t position, bool guarded) {
  TORCH_CHECK(kernel >= 0 && kernel < static_cast<int64_t>(g_kernels.size()), "no kernel ", kernel);
  TORCH_CHECK(plan >= 0 && plan < kMaxPlans, "plan ", plan, " out of range");
  TORCH_CHECK(kind >= PYTHON && kind <= FP32_OPT_DTYPE, "unknown rule kind ", kind);
  TORCH_CHECK(kind != FP32_OPT_DTYPE || position >= 0, "an fp32-unless-dtype rule needs its position");
  TORCH_CHECK(!guarded || kind != PYTHON, "a Python rule is never guarded (its handler refuses itself)");
  uint32_t packed = static_cast<uint32_t>(kind) | (guarded ? kGuarded : 0u) |
                    (static_cast<uint32_t>(position < 0 ? 0 : position) << 8);
  g_kernels[kernel]->rules[plan].store(packed, std::memory_order_relaxed);
}

c10::DispatchKey native_key_of(c10::DeviceType device) {
  switch (device) {
    case c10::DeviceType::CUDA: return c10::DispatchKey::AutocastCUDA;
    case c10::DeviceType::XPU: return c10::DispatchKey::AutocastXPU;
    case c10::DeviceType::MPS: return c10::DispatchKey::AutocastMPS;
    default: return c10::DispatchKey::AutocastCPU;
  }
}

void set_top(bool on, int64_t depth, const std::string& device_type, pybind11::object dtype, int64_t plan) {
  Top top;
  top.on = on;
  if (on) {
    TORCH_CHECK(THPDtype_Check(dtype.ptr()), "set_top: dtype must be a torch.dtype");
    top.depth = depth;
    top.device = c10::Device(device_type).type();
    top.dtype = reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
    top.native_key = native_key_of(top.device);
    top.plan = static_cast<int>(plan);
  }
  tls = top;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dispatch_amp's compiled engine (see src/dispatch_amp/_compiled/csrc/engine.cpp)";
  m.def("built_against", [] {
    return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
           std::to_string(TORCH_VERSION_PATCH);
  });
  m.def("init", &init);
  m.def("register_kernel", &register_kernel);
  m.def("set_rule", &set_rule);
  m.def("set_top", &set_top);
  m.def("max_plans", [] { return kMaxPlans; });
  m.def("unboxed_overloads", [] {  // the registered overloads whose kernel is unboxed
    std::vector<std::string> out(g_fast.begin(), g_fast.end());
    std::sort(out.begin(), out.end());
    return out;
  });
  m.def("unboxed_counts", [] {  // this thread's unboxed calls: (executed here, handed to the boxed kernel)
    return pybind11::make_tuple(tl_unboxed.executed, tl_unboxed.handed);
  });
  m.def("unboxed_candidates", [] {  // every overload that would get an unboxed kernel
    std::vector<std::string> out;
    for (const auto& kv : fast_overloads()) out.push_back(kv.first);
    std::sort(out.begin(), out.end());
    return out;
  });
  m.def("bump_generation", [] { g_generation.fetch_add(1, std::memory_order_acq_rel); });
  m.def("set_scopes_open", [](int64_t n) { g_scopes.store(n, std::memory_order_release); });
  m.def("top", [] {
    return pybind11::make_tuple(tls.on, tls.depth, static_cast<int>(tls.device),
                                static_cast<int>(tls.dtype), tls.plan);
  });
  pybind11::class_<Store, std::shared_ptr<Store>>(m, "Store")
      .def(pybind11::init<>())
      .def("clear", &Store::clear, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("close", [](Store& s) { s.open.store(false); })
      .def_property_readonly("open", [](Store& s) { return s.open.load(); })
      .def("set_max_bytes", &Store::set_max_bytes, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("total_nbytes", &Store::total_nbytes)
      .def("nbytes", [](Store& s) { std::lock_guard<std::mutex> lock(s.mu); return s.nbytes; })
      .def("__len__", &Store::size)
      .def("cast", [](Store& s, const at::Tensor& t, pybind11::object dtype, pybind11::object to) {
        TORCH_CHECK(THPDtype_Check(dtype.ptr()), "Store.cast: dtype must be a torch.dtype");
        return s.cast(t, reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type, to.ptr());
      });
  m.def("region_store", [] { return g_region; });
  m.def("set_batching", [](bool on) { return g_batching.exchange(on); });
  m.def("batching", [] { return g_batching.load(); });
  m.def("region_closed", &region_closed);
  m.def("plans", [] {  // this thread's plans: the weights per bucket, most recent first
    pybind11::list out;
    for (const auto& p : tl_plans) {
      pybind11::list buckets;
      const Plan& plan = *p.second;
      for (size_t b = 0; b < plan.buckets(); ++b) buckets.append(plan.starts[b + 1] - plan.starts[b]);
      out.append(buckets);
    }
    return out;
  });
}
