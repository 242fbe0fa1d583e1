"""Helpers the test areas share (not tests): certificates, Redis servers, snapshots, store
contracts, paths.  Imported as ``tests.support.<module>``."""
