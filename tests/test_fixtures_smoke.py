from belayer.storage.s3client import make_s3_client


def test_seaweedfs_fixture_round_trip(storage_config):
    client = make_s3_client(storage_config)
    key = storage_config.key_prefix + "hello"
    client.put_object(Bucket=storage_config.bucket, Key=key, Body=b"hi")
    assert client.get_object(Bucket=storage_config.bucket, Key=key)["Body"].read() == b"hi"
