module github.com/vlkv/vlkv

go 1.26.8

require (
	github.com/gofrs/flock v0.13.1
	github.com/klauspost/compress v1.20.3
	github.com/kluctl/go-embed-python v0.0.0-3.13.1-20241219-1
	github.com/mattn/go-isatty v0.0.20
	github.com/rs/zerolog v1.35.1
	github.com/spf13/cobra v1.10.2
	github.com/ulikunitz/xz v0.5.17
)

require (
	github.com/inconshreveable/mousetrap v1.1.0 // indirect
	github.com/mattn/go-colorable v0.1.14 // indirect
	github.com/sirupsen/logrus v1.9.4 // indirect
	github.com/spf13/pflag v1.0.9 // indirect
	golang.org/x/sync v0.21.0 // indirect
	golang.org/x/sys v0.47.0 // indirect
)
