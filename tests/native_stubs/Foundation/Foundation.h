// Stand-in for <Foundation/Foundation.h>: the classes and types the native layer and PyTorch's
// ATen/mps headers name, with Apple's documented signatures. Not Apple's header.
#pragma once

#include <dispatch/dispatch.h>
#include <stddef.h>
#include <stdint.h>

#define NS_ASSUME_NONNULL_BEGIN _Pragma("clang assume_nonnull begin")
#define NS_ASSUME_NONNULL_END _Pragma("clang assume_nonnull end")

typedef unsigned long NSUInteger;
typedef long NSInteger;
typedef signed char BOOL;
typedef double CFTimeInterval;  // (CoreFoundation's, which Foundation includes)
#define YES ((BOOL)1)
#define NO ((BOOL)0)
#ifndef nil
#define nil nullptr
#endif
#define NS_ENUM(_type, _name) enum _name : _type _name; enum _name : _type

NS_ASSUME_NONNULL_BEGIN

@protocol NSObject
@end

__attribute__((objc_root_class))
@interface NSObject <NSObject> {
  Class isa;  // (as Apple's NSObject.h declares it)
}
+ (instancetype)alloc;
+ (instancetype) new;
- (instancetype)init;
- (BOOL)respondsToSelector:(SEL)aSelector;
@end

typedef NSUInteger NSStringEncoding;
static const NSStringEncoding NSASCIIStringEncoding = 1;
static const NSStringEncoding NSUTF8StringEncoding = 4;

@interface NSString : NSObject
+ (nullable instancetype)stringWithUTF8String:(const char*)nullTerminatedCString;
- (nullable instancetype)initWithBytes:(const void*)bytes
                                length:(NSUInteger)len
                              encoding:(NSStringEncoding)encoding;
@property(nullable, readonly) const char* UTF8String;
@end

typedef struct {
  unsigned long state;
  id __unsafe_unretained _Nullable* _Nullable itemsPtr;
  unsigned long* _Nullable mutationsPtr;
  unsigned long extra[5];
} NSFastEnumerationState;

@protocol NSFastEnumeration
- (NSUInteger)countByEnumeratingWithState:(NSFastEnumerationState*)state
                                  objects:(id __unsafe_unretained _Nullable[_Nonnull])buffer
                                    count:(NSUInteger)len;
@end

@interface NSArray<__covariant ObjectType> : NSObject <NSFastEnumeration>
@property(readonly) NSUInteger count;
- (ObjectType)objectAtIndex:(NSUInteger)index;
@end

@interface NSDictionary<__covariant KeyType, __covariant ObjectType> : NSObject <NSFastEnumeration>
@property(readonly) NSUInteger count;
@end

@interface NSURL : NSObject
+ (NSURL*)fileURLWithPath:(NSString*)path;
@end

typedef NSString* NSErrorDomain;

@interface NSError : NSObject
@property(readonly, copy) NSErrorDomain domain;
@property(readonly) NSInteger code;
@property(readonly, copy) NSString* localizedDescription;
@end

NS_ASSUME_NONNULL_END
