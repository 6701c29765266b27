module gpusharing.io/tests/faultproxy

go 1.25.0
