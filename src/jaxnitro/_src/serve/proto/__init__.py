"""The gRPC messages and service of the Open Inference Protocol: grpc_service.proto and
the modules generate.sh makes from it (do not edit those by hand)."""
