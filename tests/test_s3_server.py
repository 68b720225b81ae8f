"""The tests' local S3 server keeps S3's guarantee that of several racing creates of one key, one wins."""

from __future__ import annotations

import sys
import threading
import uuid

import pytest

from tests.conftest import S3_ENV


def test_racing_creates_of_one_key_leave_exactly_one_winner():
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    import boto3
    from botocore.exceptions import ClientError

    from tests.s3_server import LocalS3Server

    server = LocalS3Server()
    server.start()
    interval = sys.getswitchinterval()
    # Thread switches as often as a loaded machine gives them: moto alone let 2 of 8 creates win within
    # 60 rounds so (its check and its write are separate steps).
    sys.setswitchinterval(1e-6)
    try:
        host, port = server.get_host_and_port()
        client = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
                              aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"])
        bucket = f"race-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=bucket)
        for round_ in range(40):
            barrier, won, refused = threading.Barrier(8), [], []

            def create(i: int, key: str = f"k{round_}", barrier=barrier, won=won, refused=refused) -> None:
                barrier.wait()
                try:
                    client.put_object(Bucket=bucket, Key=key, Body=b"%d" % i, IfNoneMatch="*")
                    won.append(i)
                except ClientError as exc:
                    refused.append(exc.response["Error"]["Code"])

            threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len(won) == 1 and len(refused) == 7, (round_, won, refused)
            body = client.get_object(Bucket=bucket, Key=f"k{round_}")["Body"].read()
            assert body == b"%d" % won[0]  # the winner's bytes, not a loser's written over them
    finally:
        sys.setswitchinterval(interval)
        server.stop()
