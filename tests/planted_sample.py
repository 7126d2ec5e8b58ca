"""Two quick planted engines, for testing ``shardkit bench --planted`` without the whole suite."""

from tests.planted import FailedCallsNotCounted, OutputDependsOnChunking, names_its_property

PLANTED = (FailedCallsNotCounted, OutputDependsOnChunking)

__all__ = ["PLANTED", "FailedCallsNotCounted", "OutputDependsOnChunking", "names_its_property"]
