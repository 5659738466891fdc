// Stand-in for <Metal/Metal.h>: the protocols, classes and types the native layer and PyTorch's
// ATen/mps headers name, with the signatures of Apple's Metal documentation. Not Apple's header.
#pragma once

#include <Foundation/Foundation.h>

#define BNB_STUB_AVAILABLE(v) __attribute__((availability(macos, introduced = v)))
#define BNB_STUB_DEPRECATED(v) __attribute__((availability(macos, deprecated = v)))

NS_ASSUME_NONNULL_BEGIN

typedef struct {
  NSUInteger width, height, depth;
} MTLSize;

static inline MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth) {
  MTLSize size = {width, height, depth};
  return size;
}

typedef NS_ENUM(NSUInteger, MTLLanguageVersion){
    MTLLanguageVersion3_0 BNB_STUB_AVAILABLE(13.0) = (3 << 16) + 0,
    MTLLanguageVersion3_1 BNB_STUB_AVAILABLE(14.0) = (3 << 16) + 1,
    MTLLanguageVersion3_2 BNB_STUB_AVAILABLE(15.0) = (3 << 16) + 2,
    MTLLanguageVersion4_0 BNB_STUB_AVAILABLE(26.0) = (4 << 16) + 0,
};

typedef NS_ENUM(NSInteger, MTLMathMode){
    MTLMathModeSafe = 0,
    MTLMathModeRelaxed = 1,
    MTLMathModeFast = 2,
} BNB_STUB_AVAILABLE(15.0);

typedef NS_ENUM(NSInteger, MTLMathFloatingPointFunctions){
    MTLMathFloatingPointFunctionsFast = 0,
    MTLMathFloatingPointFunctionsPrecise = 1,
} BNB_STUB_AVAILABLE(15.0);

@interface MTLCompileOptions : NSObject
@property(readwrite, nonatomic) BOOL fastMathEnabled BNB_STUB_DEPRECATED(15.0);
@property(readwrite, nonatomic) MTLMathMode mathMode BNB_STUB_AVAILABLE(15.0);
@property(readwrite, nonatomic)
    MTLMathFloatingPointFunctions mathFloatingPointFunctions BNB_STUB_AVAILABLE(15.0);
@property(readwrite, nonatomic) MTLLanguageVersion languageVersion;
@end

@protocol MTLResource <NSObject>
@end

@protocol MTLBuffer <MTLResource>
@property(readonly) NSUInteger length;
@end

@protocol MTLFunction <NSObject>
@property(readonly) NSString* name;
@end

@protocol MTLLibrary <NSObject>
- (nullable id<MTLFunction>)newFunctionWithName:(NSString*)functionName;
@property(readonly) NSArray<NSString*>* functionNames;
@end

@protocol MTLComputePipelineState <NSObject>
@property(readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@property(readonly) NSUInteger threadExecutionWidth;
@property(readonly) NSUInteger staticThreadgroupMemoryLength;
@end

@protocol MTLCommandEncoder <NSObject>
- (void)endEncoding;
@end

@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)setBuffer:(nullable id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
- (void)dispatchThreads:(MTLSize)threadsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
@end

typedef NS_ENUM(NSUInteger, MTLCommandBufferStatus){
    MTLCommandBufferStatusNotEnqueued = 0, MTLCommandBufferStatusEnqueued = 1,
    MTLCommandBufferStatusCommitted = 2,   MTLCommandBufferStatusScheduled = 3,
    MTLCommandBufferStatusCompleted = 4,   MTLCommandBufferStatusError = 5,
};

@protocol MTLCommandBuffer;
typedef void (^MTLCommandBufferHandler)(id<MTLCommandBuffer>);

@protocol MTLCommandBuffer <NSObject>
- (void)commit;
- (void)addCompletedHandler:(MTLCommandBufferHandler)block;
@property(readonly) MTLCommandBufferStatus status;
@property(nullable, readonly) NSError* error;
@property(readonly) CFTimeInterval GPUStartTime BNB_STUB_AVAILABLE(10.15);
@property(readonly) CFTimeInterval GPUEndTime BNB_STUB_AVAILABLE(10.15);
@end

@protocol MTLCommandQueue <NSObject>
@end

@protocol MTLEvent <NSObject>
@end

@protocol MTLSharedEvent <MTLEvent>
@end

@protocol MTLDevice <NSObject>
@property(readonly) NSString* name;
- (nullable id<MTLLibrary>)newLibraryWithSource:(NSString*)source
                                        options:(nullable MTLCompileOptions*)options
                                          error:(__autoreleasing NSError* _Nullable* _Nullable)error;
- (nullable id<MTLLibrary>)newLibraryWithURL:(NSURL*)url
                                       error:(__autoreleasing NSError* _Nullable* _Nullable)error;
- (nullable id<MTLComputePipelineState>)
    newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction
                                  error:(__autoreleasing NSError* _Nullable* _Nullable)error;
@end

NS_ASSUME_NONNULL_END
