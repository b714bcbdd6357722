"""Sampling parameters at the worker's gRPC boundary: bad values get INVALID_ARGUMENT naming the request."""

import grpc
import pytest

from specdec.v1 import worker_pb2 as pb
from specdec.v1 import worker_pb2_grpc
from worker_service.runtime.loader import load_model
from worker_service.runtime.runner import ModelRunner
from worker_service.serving.server import create_server
from worker_service.speculation.config import WorkerConfig
from worker_service.speculation.worker import Worker


@pytest.fixture(scope="module")
def stub(tiny_pair):
    """A real Worker service on 127.0.0.1 (port 0), serving the tiny target in this process."""
    server, servicer, port = create_server("127.0.0.1", 0)
    worker = Worker(WorkerConfig(model=str(tiny_pair.target_path)), ModelRunner(load_model(tiny_pair.target_path)))
    servicer.set_worker(worker, "tiny")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        session_id = stub.InitCache(pb.InitCacheRequest(num_blocks=64, block_size=4)).session_id
        yield stub, session_id
    server.stop(None)
    servicer.close()


def one_step(stub_and_session, request_id: str, sampling: pb.RequestSampling) -> pb.ExecuteModelResponse:
    """One step on a stream of its own; returns once the worker has ended the stream."""
    stub, session_id = stub_and_session
    new = pb.NewRequest(
        request_id=request_id,
        token_ids=[5, 6, 7],
        num_prompt_tokens=3,
        sampling=sampling,
        block_ids=[0, 1],
        num_new_tokens=3,
    )
    step = pb.ExecuteModelRequest(step_id=1, new_requests=[new], finished_request_ids=[request_id])
    responses = list(stub.ExecuteModel(iter([step]), metadata=[("specdec-session-id", session_id)]))
    return responses[0]


@pytest.mark.parametrize(
    "sampling, fragment",
    [
        (pb.RequestSampling(temperature=-1.0, top_p=1.0), "temperature must be >= 0"),
        (pb.RequestSampling(temperature=float("nan"), top_p=1.0), "temperature must be >= 0"),
        (pb.RequestSampling(temperature=1.0, top_p=0.0), "top_p must be in (0, 1]"),
        (pb.RequestSampling(temperature=1.0, top_p=1.0, top_k=-3), "top_k must be an integer >= 0"),
    ],
)
def test_bad_sampling_is_invalid_argument_naming_the_request(stub, sampling, fragment):
    with pytest.raises(grpc.RpcError) as info:
        one_step(stub, "bad-sampling", sampling)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request 'bad-sampling'" in info.value.details() and fragment in info.value.details()
    # The worker keeps serving.
    assert one_step(stub, "good", pb.RequestSampling(temperature=0.0, top_p=1.0)).outputs[0].token_ids
