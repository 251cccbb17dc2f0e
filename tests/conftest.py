pytest_plugins = ["tests.s3_fixtures"]
