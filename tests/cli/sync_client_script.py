"""A plain script using the sync Client while another event loop in the process serves gRPC.

Run by test_sdk_api.py: before the sync client shared one never-closed loop, grpc.aio printed
"Exception in callback PollerCompletionQueue._handle_events ... Event loop is closed" here.
"""

import asyncio
import threading
import time

import grpc

from flexmarl.client import Client
from flexmarl.v1 import orchestrator_pb2, orchestrator_pb2_grpc


class Orchestrator(orchestrator_pb2_grpc.OrchestratorServicer):
    async def WatchJob(self, request, context):  # noqa: N802
        for _ in range(3):
            yield orchestrator_pb2.JobStatus(job_id=request.job_id, state=orchestrator_pb2.JOB_STATE_RUNNING)
            await asyncio.sleep(0.05)
        yield orchestrator_pb2.JobStatus(job_id=request.job_id, state=orchestrator_pb2.JOB_STATE_SUCCEEDED)


ports: list[int] = []


def serve() -> None:
    async def main() -> None:
        server = grpc.aio.server()
        orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(Orchestrator(), server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await asyncio.sleep(60)

    asyncio.run(main())


threading.Thread(target=serve, daemon=True).start()
deadline = time.monotonic() + 30
while not ports and time.monotonic() < deadline:
    time.sleep(0.01)
for _ in range(2):  # two clients one after the other, as scripts do
    with Client(f"127.0.0.1:{ports[0]}") as client:
        print("final", client.wait("job-1", 10).state.name)
        print("seen", sum(1 for _ in client.watch("job-1")))
time.sleep(0.5)  # late completion-queue events would be printed now
print("done")
