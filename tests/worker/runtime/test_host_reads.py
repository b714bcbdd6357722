"""The host reads of a worker step: each one a wait for the GPU on CUDA, so each is held to a decided list.

On CUDA, reading a device tensor into Python (`.tolist()`, `.item()`, `bool()`, an op whose output size
depends on the data, such as `nonzero`) waits until the GPU has finished everything queued before it: the host
cannot prepare the next launches meanwhile. `HostReads` finds them on the CPU, where nothing waits: it
counts reads of every tensor except those built on the host from Python data (`torch.tensor`, a factory
without a `device`) and what is computed only from them, the tensors that stay on the host on a GPU too. The
C kernels write through pointers, out of torch's sight, so what they fill counts as the device's: it is.

Decided (the tests below hold them; a new read fails them until it is added here, with why it is needed):
- one read per step, of the emitted tokens (one-hot drafts and greedy rows: `verify._accept_one_hot`; sampled
  rows with a draft model's probabilities: `verify._rejection_sample`);
- one more where a request asks for logprobs (`verify._logprobs`: the emitted tokens' and the top ones
  together), after the first: which rows' logprobs to read depends on the tokens;
- the draft model's proposer, one per draft position (each next draft is the argmax of the last, read to
  build the next step's chunk). A proposer that drafts on the device without reading back is future work.
"""

import collections
import pathlib
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kernels._triton import HAS_TRITON
from specdec import step
from tests.worker.speculation import test_speculative
from worker_service.runtime.loader import load_model
from worker_service.runtime.runner import ModelRunner
from worker_service.speculation.config import WorkerConfig
from worker_service.speculation.worker import Worker

aten = torch.ops.aten
# Ops whose output size the host needs before it can go on: a wait on CUDA (`.item()`, `bool()` and the other
# conversions to Python are READS, caught where Python calls them).
DATA_DEPENDENT = frozenset(
    {
        aten.nonzero.default,
        aten.masked_select.default,
        aten.equal.default,
        aten.unique_consecutive.default,
        aten._unique2.default,
        aten.repeat_interleave.Tensor,
    }
)
READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy")
HOST_BUILT = frozenset({aten.lift_fresh.default, aten.lift_fresh_copy.default})
ROOT = pathlib.Path(__file__).resolve().parents[3]


class HostReads(TorchDispatchMode):
    """Counts host reads of device tensors by the (kind, file:function) that made them (module docstring)."""

    def __init__(self):
        super().__init__()
        self.host: set[int] = set()  # ids of tensors that stay on the host
        self.alive: list[torch.Tensor] = []  # keeps those ids from being reused while recording
        self.sites: collections.Counter = collections.Counter()
        self._originals = {}

    def _record(self, kind: str) -> None:
        ours = [
            f for f in traceback.extract_stack() if f.filename.startswith(str(ROOT)) and "/tests/" not in f.filename
        ]
        frame = ours[-1] if ours else traceback.extract_stack()[-3]
        self.sites[kind, f"{pathlib.Path(frame.filename).name}:{frame.name}"] += 1

    def __enter__(self):
        recorder = self
        for name in READS:
            original = self._originals[name] = getattr(torch.Tensor, name)

            def read(tensor, *args, _original=original, _name=name, **kwargs):
                if id(tensor) not in recorder.host:
                    recorder._record(_name)
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, read)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func in HOST_BUILT:
            host = True
        else:
            host = all(id(t) in self.host for t in inputs) and kwargs.get("device") is None
        if not host and func in DATA_DEPENDENT:
            self._record(func.overloadpacket.__name__)
        out = func(*args, **kwargs)
        if host:
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor):
                    self.host.add(id(tensor))
                    self.alive.append(tensor)
        return out


def test_the_recorder_counts_a_read_of_a_computed_tensor_and_not_of_host_data():
    weight = torch.ones(3)  # made before recording: as the model's weights, the device's
    with HostReads() as reads:
        host = torch.tensor([1, 2, 3])
        host.tolist()
        (host + 1).tolist()
        int(host.sum())
        out = weight * 2
        out.tolist()
        bool(out.any())
        out.nonzero()
    assert sum(reads.sites.values()) == 3
    assert {kind for kind, _ in reads.sites} == {"tolist", "__bool__", "nonzero"}


GREEDY = step.RequestSampling(temperature=0.0)
SAMPLED = step.RequestSampling(temperature=0.8, top_p=0.9, seed=7, logprobs=True, top_logprobs=2, presence_penalty=0.5)


def step_reads(worker, sampling: step.RequestSampling, k: int) -> collections.Counter:
    """The host reads of one decode (k = 0) or verify (k drafts) step of two requests, after their prefill."""
    prompts = [test_speculative.PROMPTS[0], test_speculative.PROMPTS[2]]
    new = [
        step.NewRequest(f"r{i}", p, len(p), sampling, list(range(i * 20, i * 20 + 20)), len(p), k)
        for i, p in enumerate(prompts)
    ]
    worker.execute(step.StepRequest(0, new_requests=new))
    cached = [step.CachedRequest(f"r{i}", [], 20, 1, k) for i in range(2)]
    with HostReads() as reads:
        result = worker.execute(step.StepRequest(1, cached_requests=cached))
    assert all(out.num_draft_tokens == k for out in result.outputs)  # the step drafted what it was asked
    return reads.sites


def expected_reads(sampling: step.RequestSampling, model_drafts: bool = False) -> collections.Counter:
    """The decided reads of a step's verification (module docstring); `model_drafts`: a draft model's drafts
    with their probabilities were verified."""
    if sampling is GREEDY:
        return collections.Counter({("tolist", "verify.py:_accept_one_hot"): 1})
    accept = "verify.py:_rejection_sample" if model_drafts else "verify.py:_accept_one_hot"
    return collections.Counter({("tolist", accept): 1, ("tolist", "verify.py:_logprobs"): 1})


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_decode_step_reads_the_host_once_and_once_more_for_logprobs(tiny_pair, sampling):
    worker = test_speculative.make_worker(tiny_pair, "ngram", 3)
    assert step_reads(worker, sampling, 0) == expected_reads(sampling)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_verify_step_reads_as_a_decode_step_does_beside_its_proposer(tiny_pair, sampling):
    worker = test_speculative.make_worker(tiny_pair, "draft", 3)
    assert step_reads(worker, sampling, 3) == expected_reads(sampling, model_drafts=True) + collections.Counter(
        {("tolist", "draft.py:propose"): 3}
    )


def gpu_forward_worker(pair, proposer: str, k: int) -> Worker:
    """A worker whose target runs the GPU forward (backends/gpu_llama.py), here in Triton's interpreter: a read
    in its Python (the backend, the kernels' wrappers) would also stop a CUDA graph's capture."""
    from tests.worker.runtime.test_gpu_forward import runner_with

    config = WorkerConfig(
        model=str(pair.target_path),
        proposer=proposer,
        num_speculative_tokens=k,
        draft_model=str(pair.draft_path) if proposer == "draft" else None,
        dtype="float32",
    )
    draft = ModelRunner(load_model(pair.draft_path, "float32")) if proposer == "draft" else None
    worker = Worker(config, runner_with("gpu_llama", pair.target_path, "float32", "cpu"), draft)
    worker.init_cache(test_speculative.NUM_BLOCKS, test_speculative.BLOCK_SIZE)
    return worker


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_gpu_forwards_steps_read_the_host_as_the_others_do(tiny_pair, sampling):
    assert step_reads(gpu_forward_worker(tiny_pair, "ngram", 3), sampling, 0) == expected_reads(sampling)
    assert step_reads(gpu_forward_worker(tiny_pair, "draft", 3), sampling, 3) == expected_reads(
        sampling, model_drafts=True
    ) + collections.Counter({("tolist", "draft.py:propose"): 3})
